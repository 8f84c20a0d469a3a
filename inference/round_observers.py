"""The engine's hook for serving-time adaptation: an observer of every query and verified round of a drafter.

Tree algorithms over a feature-conditioned drafter (``eagle3_tree``, ``specblock_tree``) take ``adapt=NAME``. For a
name other than ``none`` they ask the registered :class:`ObserverKind` to ``attach`` to the drafter: it returns the
drafter to serve from (a private copy whose weights the observer may change between rounds) and the
:class:`RoundObserver` that is then told about each query (``begin_query``), each verified round
(``observe_round``) and the end of each query (``end_query``). The engine never names an implementation: a package
registers its kinds as entry points of the group ``spectrain.round_observers`` (spectrain's own ``bandit`` in
pyproject.toml), found when ``adapt=`` asks and imported only then; ``register_observer`` adds one in-process.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from collections.abc import Hashable
from typing import Any, Protocol

import torch
from torch import nn

ENTRY_POINT_GROUP = "spectrain.round_observers"
_REGISTERED: dict[str, Any] = {}  # name -> ObserverKind added by register_observer


class RoundObserver(Protocol):
    """Every call names its query (the engine's request key, unique among the queries under way), so an observer
    can tell apart queries whose rounds interleave (requests served side by side, ``batch_size`` > 1)."""

    def begin_query(
        self, query: Hashable, prompt_ids: list[int], features: torch.Tensor, last_logits: torch.Tensor, max_accept: int
    ) -> None:
        """After prefill: the prompt's features [P, F] and the target's logits at its last position [V]."""

    def observe_round(
        self,
        query: Hashable,
        tokens: list[int],
        features: torch.Tensor,
        target_logits: torch.Tensor,
        accepted: int,
        rejected: tuple[torch.Tensor, int] | None,
        seconds: float,
    ) -> None:
        """After one verification: the committed ``tokens`` (root + accepted path), their features [n, F], target
        logits [n, V], (draft logits, the target's token) at the rejected position, if the drafter drafted
        there, and ``seconds``: the query's share of the engine step that ran the round (the step's wall seconds
        x the target rows the query's tree was scored on / all rows the step scored; a query alone: the whole
        step), so a round costs the same thing whether the query ran alone or beside others."""

    def end_query(self, query: Hashable, last_token: int) -> Any:
        """After the last verification of a query."""


class ObserverKind(Protocol):
    def settings(self, given: dict[str, str]) -> Any:
        """The observer's settings from ``adapt.NAME=VALUE`` (NAME -> VALUE as written); refuses (one line, a
        ``ValueError`` or ``core.errors.UserError``) a name or value it does not take."""

    def attach(
        self, target: Any, drafter: nn.Module, settings: Any, *, verify_tokens: int, max_accept: int
    ) -> tuple[nn.Module, RoundObserver]:
        """``(drafter to serve from, observer)`` for ``drafter`` served with ``target``; ``settings`` None means
        the defaults."""


def register_observer(name: str, kind: ObserverKind) -> None:
    """Make ``adapt=name`` attach ``kind`` in this process (packages use the entry-point group instead)."""
    _REGISTERED[name] = kind


def observer_names() -> list[str]:
    """Every ``adapt=`` name but ``none``: the installed entry points and those registered in-process."""
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)} | set(_REGISTERED))


def check_observer(name: str) -> None:
    """Refuse (one line) an ``adapt=`` name that is neither ``none`` nor registered."""
    if name != "none" and name not in observer_names():
        choices = " or ".join(f"adapt={n}" for n in ("none", *observer_names()))
        raise ValueError(
            f"adapt={name} is unknown; use {choices} (kinds come from the '{ENTRY_POINT_GROUP}' entry "
            "points of installed packages: `pip install -e .` registers spectrain's bandit)"
        )


def observer_kind(name: str) -> ObserverKind:
    check_observer(name)
    if name in _REGISTERED:
        return _REGISTERED[name]
    (point,) = entry_points(group=ENTRY_POINT_GROUP, name=name)
    return point.load()


class ObserverTap:
    """A :class:`RoundObserver` that forwards every call to ``inner`` and hands what ``end_query`` returns (for
    spectrain's ``bandit`` entry point, the query's decision row) to ``listener``: how a server counts the
    decisions of whichever registered kind ``adapt=`` attached, without importing it. Other attributes (``log``,
    ``close``) read through to ``inner``."""

    def __init__(self, inner: RoundObserver, listener):
        self.inner, self.listener = inner, listener

    def begin_query(self, *args, **kwargs) -> None:
        self.inner.begin_query(*args, **kwargs)

    def observe_round(self, *args, **kwargs) -> None:
        self.inner.observe_round(*args, **kwargs)

    def end_query(self, query: Hashable, last_token: int) -> Any:
        outcome = self.inner.end_query(query, last_token)
        if outcome:
            self.listener(outcome)
        return outcome

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copy, pickle): no endless lookup through __getattr__
            raise AttributeError(name)
        return getattr(self.inner, name)
