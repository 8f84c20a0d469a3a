"""What PEARL and SpecBranch share: the executor around their draft side (``inference.draft_side``), and the
figures it adds to a run; and what they and SSD share on the engine loop: one row at a time."""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch

from core.errors import UserError
from inference.algorithms.base import Algorithm
from inference.engine.strategy import Strategy
from inference.draft_side import draft_side_from_path, draft_side_from_runner
from inference.executors import EXECUTORS, DraftFactory, Executor, OverlapStats, make_executor
from inference.runner_contract import check_same_vocab


class OneRowStrategy(Strategy):
    """A strategy whose draft side, running beside the target, holds one sequence: it takes one request at a time
    on the engine loop (``open`` refuses more rows in one line) and has the algorithm's executor while open."""

    one_row_because = "its draft side holds one sequence"
    other_ways = ""  # what else serves several requests, for the refusal

    def __init__(self, algorithm: Algorithm):
        self.algorithm = algorithm
        self.executor: Executor | None = None

    def lookahead(self) -> int:
        return self.algorithm.lookahead()

    def open(self, rows: int) -> None:
        if rows != 1:
            raise UserError(
                f"{self.name} takes one request at a time ({self.one_row_because}), got rows={rows}; "
                f"serve it with batch_size=1{self.other_ways}"
            )
        self.executor = self.open_executor()

    def open_executor(self) -> Executor:
        """The algorithm's executor, built (a draft process started) before a request's clock starts."""
        return self.algorithm.executor


class OverlappedDraftAlgorithm(Algorithm):
    """An algorithm whose draft work runs on a :class:`DraftSide` through an executor (docs/architecture.md §6.6)."""

    drafter = "draft_lm"

    def __init__(
        self,
        target,
        draft,
        *,
        executor: str = "sequential",
        draft_path: str | None = None,
        draft_factory: DraftFactory | None = None,
        max_batch: int = 1,
        max_seq_len: int | None = None,
        executor_kwargs: dict | None = None,
    ):
        """``draft_factory`` builds the draft side (default: over ``draft`` in this process, or from
        ``draft_path`` in a child process for ``executor=multiprocess``)."""
        super().__init__(target, max_seq_len=max_seq_len)
        if executor not in EXECUTORS:
            raise ValueError(f"unknown executor '{executor}'; choose one of {', '.join(EXECUTORS)}")
        check_same_vocab(target, draft)
        self.max_seq_len = min(self.max_seq_len, draft.max_seq_len)
        if draft_factory is None:
            if executor == "multiprocess":
                if not draft_path:
                    raise ValueError(
                        "executor=multiprocess loads the draft LM in its own process and needs its path: "
                        "pass drafter=PATH (a directory), or use executor=sequential"
                    )
                # "cuda" = the child's current device (cuda:1 under NCCL), not the parent's draft device
                device = "cuda" if torch.device(draft.device).type == "cuda" else "cpu"
                draft_factory = functools.partial(
                    draft_side_from_path,
                    str(draft_path),
                    device=device,
                    max_seq_len=draft.max_seq_len,
                    max_batch=max_batch,
                    logit_vocab=getattr(draft, "logit_vocab", None),
                    dtype=draft.dtype,
                )
            else:
                draft_factory = functools.partial(draft_side_from_runner, draft, max_batch)
        self.executor_name = executor
        self.draft_factory = draft_factory
        self.executor_kwargs = dict(executor_kwargs or {})
        self._executor: Executor | None = None
        self._period = {"wall_s": 0.0, "tokens": 0, "stats": OverlapStats()}

    @property
    def executor(self) -> Executor:
        # built on first use (a multiprocess executor starts a process), and again after its draft process died
        if self._executor is None or self._executor.broken:
            self._executor = make_executor(self.executor_name, self.draft_factory, **self.executor_kwargs)
        return self._executor

    def close(self) -> None:
        if getattr(self, "_executor", None) is not None:  # none on an object whose constructor refused an option
            self._executor.close()
            self._executor = None

    def __del__(self) -> None:
        # at interpreter shutdown the modules close() needs may be gone already; the draft process is a daemon and
        # ends with the interpreter. Otherwise a failure to release is a bug, reported (Python prints it)
        if sys is not None and not sys.is_finalizing():  # late in shutdown the module global itself is None
            self.close()

    def start_draft(self, generator: torch.Generator | None) -> None:
        """Reset the draft side for a new generation; its seed comes from the algorithm's generator, so one
        injected generator fixes both sides' random streams on every executor."""
        seed = (
            int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
            if generator is not None
            else 0
        )
        self.executor.call("start", seed)

    def note_generation(self, wall_s: float, tokens: int) -> None:
        self._period["wall_s"] += wall_s
        self._period["tokens"] += tokens

    def extra_metrics(self) -> dict[str, Any]:
        """Executor timing since the previous call: real and simulated-overlap tokens/s (simulated = time outside
        the executor + Σ max(t_target, t_draft) inside it)."""
        now = self._executor.stats if self._executor is not None else OverlapStats()
        before: OverlapStats = self._period["stats"]
        delta = OverlapStats(**{k: v - getattr(before, k) for k, v in now.as_dict().items()})
        wall, tokens = self._period["wall_s"], self._period["tokens"]
        simulated = max(wall - delta.wall_s + delta.simulated_s, 0.0)
        self._period = {"wall_s": 0.0, "tokens": 0, "stats": OverlapStats(**now.as_dict())}
        return {
            "executor": self.executor_name,
            "overlap": {k: round(v, 4) for k, v in delta.as_dict().items()},
            "simulated_tokens_per_s": round(tokens / simulated, 3) if simulated > 0 else 0.0,
        }
