"""Engine arguments -> a running algorithm: what ``inference.evaluate``, ``inference.generate`` and
``inference.serve`` share (vLLM's ``EngineArgs`` -> engine is the shape).

:class:`EngineArgs` is the target, where its drafters come from, every algorithm's options, sampling and placement.
Algorithm options are scoped by algorithm (``ssd.budget=8``; :func:`parse_engine_cli` still reads the flat
spellings of the previous release, ``ssd_budget=8``, with a warning). An algorithm label is ``NAME`` or a variant
``NAME@key=value[@key=value]`` that changes only what a variant may: its own options by their names
(``ssd@budget=8``), ``adapt``, sampling and the answer's length (``RUN_VARIANT_KEYS``).
:func:`check_algorithm_options` refuses an option none of the chosen algorithms reads, and :func:`build_variant`
builds a label over a loaded target and drafters.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from core.drafters.kinds import CAUSAL_LM_KIND, KIND_MODULES, engine_kind
from core.overrides import OverrideError, leaf_keys, parse_cli, resolve_key, schema_config, split_key_values
from inference.algorithms import ALGORITHMS, algorithm_class, build_algorithm
from inference.algorithms.options import (
    ADAPTABLE,
    ALGORITHM_KEYS,
    FLAT_ADAPT_PREFIX,
    FLAT_SPELLINGS,
    ONLY_WITH,
    OPTIONS_BY_ALGORITHM,
    AlgorithmOptions,
    Needs,
    SamplingOptions,
    option_keys,
    specbranch_option_error,
)
from inference.drafter_index import export_kind, find_exports
from inference.drafters import LoadedModel, load_drafter, load_lm, model_dtype, pick_device
from inference.round_observers import observer_kind
from inference.runner_loading import with_logit_vocab
from inference.sampling import SamplingParams


@dataclass
class EngineArgs(AlgorithmOptions):
    """The target and where its drafters come from (``drafter_paths``), every algorithm option, sampling and
    placement, and the answer's length."""

    target: str = "smollm2"
    drafters: str | None = None  # a directory of exports (spectrain.export), found by kind
    drafter: str | None = None  # a draft LM (exported dir, HF dir or registry name), or any export (by its kind)
    # drafter.<kind>=PATH on the command line (split_drafter_args): one drafter per kind, when several run together;
    # --help shows that spelling, not the field
    drafter_by_kind: dict[str, str] = field(default_factory=dict, metadata={"cli": "drafter.KIND"})
    max_new_tokens: int = 128


# What a variant NAME@key=value may change: its algorithm's options, the observer (adapt=, adapt.NAME=), sampling and
# the answer's length. The rest (models, placement, and each CLI's own keys) is fixed for the whole run: models load
# once.
SAMPLING_FILTERS = ("top_k", "top_p", "seed")  # do nothing at temperature 0 (but see _sampling_unmet)
RUN_VARIANT_KEYS = frozenset({f.name for f in fields(SamplingOptions)} | {"max_new_tokens", "adapt"})
ADAPT_PREFIX = "adapt."  # adapt.NAME=VALUE: a setting of the observer adapt= names, passed through as written


@dataclass(frozen=True)
class Given:
    """A key the command line (or a variant) set: as ``spelled``, and the schema keys it sets (several for a flat
    spelling of the previous release that more than one algorithm reads, e.g. ``gamma``)."""

    spelled: str
    keys: tuple[str, ...]


def parse_variant(label: str) -> tuple[str, list[str]]:
    """``sps@verifier=hsd@gamma=3`` -> ("sps", ["verifier=hsd", "gamma=3"])."""
    base, *overrides = label.split("@")
    for item in overrides:
        if "=" not in item:
            raise OverrideError(f"algorithm variant '{label}': '{item}' is not key=value; write NAME@key=value")
    return base, overrides


def _warn_flat(spelled: str, value: str, new: Sequence[str], where: str = "") -> None:
    """One line on stderr: the flat spelling of the previous release and the scoped one to write instead."""
    print(
        f"warning: {where}{spelled}={value} is the old spelling; write {' '.join(f'{k}={value}' for k in new)} "
        "(options are scoped by algorithm; the old spelling is accepted until the next release)",
        file=sys.stderr,
    )


def _flat(key: str) -> tuple[str, ...] | None:
    """The scoped keys a flat spelling of the previous release stands for, or None."""
    if key in FLAT_SPELLINGS:
        return FLAT_SPELLINGS[key]
    if key.startswith(FLAT_ADAPT_PREFIX) and key != "adapt_settings":
        return (ADAPT_PREFIX + key.removeprefix(FLAT_ADAPT_PREFIX),)
    return None


def parse_engine_cli(argv: Sequence[str], schema: type, usage: str) -> tuple[Any, list[Given]]:
    """``key=value`` args parsed into ``schema`` (an :class:`EngineArgs`), and what they set: algorithm options are
    ``ALGORITHM.NAME`` (``ssd.budget=8``), the observer's settings ``adapt.NAME`` (kept as written, for the
    observer to parse), one drafter per kind ``drafter.KIND=PATH`` (:func:`split_drafter_args`); a flat spelling of
    the previous release (``ssd_budget=8``, ``gamma=3``, ``adapt_horizon=7``, ``feature_drafter=``) still works,
    with a one-line warning naming the new one."""
    valid = leaf_keys(schema_config(schema))
    argv, by_kind = split_drafter_args(argv)
    rest, adapt, given = [], {}, []
    for key, value in split_key_values(argv, usage):
        keys = _flat(key) or (key,)
        if keys != (key,):
            _warn_flat(key, value, keys)
        for scoped in keys:
            if scoped.startswith(ADAPT_PREFIX):
                adapt[scoped.removeprefix(ADAPT_PREFIX)] = value
            else:
                rest.append(f"{scoped}={value}")
        given.append(Given(key, tuple(k if k.startswith(ADAPT_PREFIX) else resolve_key(k, valid) for k in keys)))
    cfg = parse_cli(rest, schema, usage)
    if adapt:
        cfg = OmegaConf.merge(cfg, {"adapt_settings": adapt})
    cfg.drafter_by_kind = by_kind
    return cfg, given


def variant_items(name: str, overrides: Sequence[str], label: str, *, warn: bool = False) -> list[tuple[Given, str]]:
    """A variant's ``key=value`` items as (what each sets, its value): a name of the algorithm's own options is
    scoped to it (``ssd@budget=8`` sets ``ssd.budget``); a flat spelling of the previous release is read as before
    (``warn``: with a warning, given once, when the run's options are checked); any other key as on the command
    line (``temperature``, ``adapt.horizon``)."""
    own = option_keys(name) if name in OPTIONS_BY_ALGORITHM else []
    items = []
    for item in overrides:
        key, value = item.split("=", 1)
        if key in own:
            keys: tuple[str, ...] = (f"{name}.{key}",)
        elif (flat := _flat(key)) is not None:
            keys = tuple(k for k in flat if k.startswith(f"{name}.")) or flat
            if warn:
                _warn_flat(key, value, [k.removeprefix(f"{name}.") for k in keys], f"algorithm variant '{label}': ")
        else:
            try:
                keys = (key if key.startswith(ADAPT_PREFIX) else resolve_key(key, _engine_keys()),)
            except OverrideError as exc:
                raise OverrideError(f"algorithm variant '{label}': {exc}") from None
        items.append((Given(key, keys), value))
    return items


@functools.cache
def _engine_keys() -> list[str]:
    return leaf_keys(schema_config(EngineArgs))


def with_overrides(cfg: Any, overrides: Sequence[str], label: str) -> Any:
    """``cfg`` with a variant's options applied (validated against the schema, like any key=value)."""
    if not overrides:
        return cfg
    if not OmegaConf.is_config(cfg):
        cfg = OmegaConf.structured(cfg)
    for item in overrides:
        # a key of the run's schema that a variant may not change; before parsing: a list key's value would fail
        # there with a vaguer message (an unknown key fails in parsing, with the closest valid one)
        key, _, value = item.partition("=")
        if key.lstrip("+") in OLD_DRAFTER_KEYS or key.lstrip("+").startswith("drafter."):  # drafters load once
            spelled = f"drafter.{OLD_DRAFTER_KEYS.get(key.lstrip('+'), key.lstrip('+').removeprefix('drafter.'))}"
            raise OverrideError(
                f"algorithm variant '{label}': '{spelled}' cannot differ per variant; set {spelled}={value} for the "
                "whole run instead"
            )
        if key in cfg and key not in RUN_VARIANT_KEYS and not OmegaConf.is_dict(cfg[key]):
            raise OverrideError(
                f"algorithm variant '{label}': '{key}' cannot differ per variant; set {item} for the whole run instead"
            )
    dotlist, adapt = [], {}
    for given, value in variant_items(parse_variant(label)[0], overrides, label):
        for key in given.keys:
            if key.startswith(ADAPT_PREFIX):
                adapt[key.removeprefix(ADAPT_PREFIX)] = value
            else:
                dotlist.append(f"{key}={value}")
    try:
        variant = parse_cli(dotlist, EngineArgs, "NAME@key=value[@key=value]")
    except OverrideError as exc:
        raise OverrideError(f"algorithm variant '{label}': {exc}") from None
    merged = OmegaConf.merge(cfg, {"adapt_settings": adapt})  # a copy, with the variant's observer settings
    for key in (item.split("=", 1)[0] for item in dotlist):
        OmegaConf.update(merged, key, OmegaConf.select(variant, key), merge=False)
    return merged


def _first_unmet(key: str, cfg: Any) -> Needs | None:
    """The first condition of ``key`` (``ONLY_WITH``) that ``cfg`` does not meet, or None: it takes effect."""
    section = cfg[key.split(".", 1)[0]]
    return next((need for need in ONLY_WITH.get(key, ()) if not need.holds(section[need.other])), None)


def _sampling_unmet(key: str, name: str, cfg: Any) -> str | None:
    """Why sampling key ``key`` does nothing for algorithm ``name`` under ``cfg`` (one clause), or None.

    At temperature 0 the output is the target's argmax, which every top-k and top-p keeps, and nothing is drawn
    from the run's generator; only SSD's fast fallback draws (its random tokens) from a generator seeded by seed."""
    if float(cfg.temperature) != 0 or (key == "top_k" and cfg.top_k == 0) or (key == "top_p" and cfg.top_p == 1):
        return None  # sampling, or a filter left off
    if key == "seed" and name == "ssd" and str(cfg.ssd.fallback) != "jit":
        return None
    return "temperature=0 (greedy: the argmax, which no top_k or top_p removes, and no random draw)"


def _reads(name: str, key: str) -> bool:
    """Whether algorithm ``name`` reads schema key ``key`` (its own options; adapt= and adapt.* if adaptable)."""
    if key == "adapt" or key.startswith(ADAPT_PREFIX):
        return name in ADAPTABLE
    return key.startswith(f"{name}.")


def _is_algorithm_key(key: str) -> bool:
    return key in ALGORITHM_KEYS or key == "adapt" or key.startswith(ADAPT_PREFIX)


def _check_read(given: Iterable[Given], runs: Sequence[tuple[str, Any]], where: str) -> None:
    """Refuse an algorithm option in ``given`` that none of ``runs`` ((algorithm, its config) pairs) reads, or that
    does nothing in every run that reads it (``ONLY_WITH``; an observer setting under adapt=none)."""
    for item in given:
        keys = [key for key in item.keys if _is_algorithm_key(key)]
        if not keys:
            continue
        readers = [(key, name, cfg) for key in keys for name, cfg in runs if _reads(name, key)]
        if not readers:
            names = list(dict.fromkeys(name for name, _ in runs))
            own = "; ".join(f"{name} reads {', '.join(_read_keys(name)) or 'no algorithm option'}" for name in names)
            owners = ", ".join(dict.fromkeys(name for key in keys for name in ALGORITHMS if _reads(name, key)))
            raise OverrideError(
                f"{where}{item.spelled} is not read by {', '.join(names)} ({own}); it is an option "
                f"of {owners}: drop it or choose an algorithm that reads it"
            )
        if keys[0].startswith(ADAPT_PREFIX):
            if all(cfg.adapt == "none" for _, _, cfg in readers):
                raise OverrideError(
                    f"{where}{keys[0]} does nothing with adapt=none; set adapt=NAME (e.g. "
                    f"adapt=bandit) or drop {keys[0]}"
                )
            continue
        unmet = [(key, _first_unmet(key, cfg), cfg) for key, _, cfg in readers]
        if all(need is not None for _, need, _ in unmet):
            key, need, cfg = unmet[0]
            name = key.split(".", 1)[0]
            raise OverrideError(
                f"{where}{key} does nothing with {name}.{need.other}={cfg[name][need.other]}; "
                f"set {name}.{need.fix} or drop {key}"
            )


def _read_keys(name: str) -> list[str]:
    return option_keys(name) + (["adapt", "adapt.*"] if name in ADAPTABLE else [])


def _check_sampling(given: Iterable[Given], runs: Sequence[tuple[str, Any]], where: str) -> None:
    """Refuse top_k, top_p (set on) or seed in ``given`` where every run samples greedily (they would do
    nothing)."""
    for item in given:
        key = item.keys[0]
        if key not in SAMPLING_FILTERS or not runs:
            continue
        reasons = [_sampling_unmet(key, name, cfg) for name, cfg in runs]
        if all(reasons):
            raise OverrideError(
                f"{where}{key} does nothing at {reasons[0]}; set temperature > 0 to sample, or drop {key}"
            )


def _check_observer(name: str, cfg: Any, where: str) -> None:
    """Refuse (one line) an unknown observer, or a setting it refuses, before any model loads."""
    if name not in ADAPTABLE or cfg.adapt == "none":
        return
    try:
        observer_kind(cfg.adapt).settings(dict(cfg.adapt_settings))
    except ValueError as exc:  # core.errors.UserError included
        raise OverrideError(f"{where}{exc}") from None


def check_algorithm_options(
    cfg: Any, given: Iterable[Given], labels: Sequence[str], *, sampling_defaults: bool = False
) -> None:
    """Refuse (one line) an unknown algorithm, and an algorithm option that the run's algorithms do not read: a
    key the command line set (``given``, from :func:`parse_engine_cli`) and each variant's own keys. ``all`` admits
    every option. Sampling filters and seed at temperature 0 are refused too, unless ``sampling_defaults`` (a
    server's: defaults for requests, which may set a temperature of their own)."""
    given = list(given)
    runs = []
    for label in labels:
        if label == "all":
            continue
        name, overrides = parse_variant(label)
        try:
            algorithm_class(name)
        except ValueError as exc:
            raise OverrideError(str(exc)) from None
        variant = with_overrides(cfg, overrides, label)
        own = [item for item, _ in variant_items(name, overrides, label, warn=True)]
        where = f"algorithm variant '{label}': "
        _check_read(own, [(name, variant)], where)
        if not sampling_defaults:
            _check_sampling(own, [(name, variant)], where)
        if name == "specbranch" and (error := specbranch_option_error(variant)):
            raise OverrideError(f"{where}{error}" if overrides else error)
        _check_observer(name, variant, where if overrides else "")
        runs.append((name, variant))
    if "all" not in labels:
        _check_read(given, runs, "")
    if not sampling_defaults:
        # a run-level key is refused only if no run samples (each variant inherits it unless it sets its own)
        _check_sampling([item for item in given if item.keys[0] in SAMPLING_FILTERS], runs, "")


def sampling_params(cfg: Any) -> SamplingParams:
    return SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)


def check_placement(cfg: Any) -> None:
    """Refuse (one line) a device or dtype this machine cannot run, before any model loads."""
    try:
        model_dtype(cfg.dtype, pick_device(cfg.device))
    except ValueError as exc:
        raise OverrideError(str(exc)) from None


# ---------------------------------------------------------------------------------------------------------------
# Drafters and the target


# The per-kind keys of earlier releases, accepted for one more with a warning naming drafter.<kind>=
OLD_DRAFTER_KEYS = {
    "feature_drafter": "eagle3",
    "specblock_drafter": "specblock",
    "dflash_drafter": "dflash",
    "peagle_drafter": "peagle",
}


def split_drafter_args(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """``argv`` without its ``drafter.<kind>=PATH`` arguments, and those as {kind: path}. The old per-kind keys
    (``feature_drafter=`` ...) are read as their ``drafter.<kind>=`` with a warning; an unknown kind is refused in
    one line."""
    rest, by_kind = [], {}
    for arg in argv:
        key, sep, path = arg.partition("=")
        key = key.lstrip("+")
        if sep and key in OLD_DRAFTER_KEYS:
            new = f"drafter.{OLD_DRAFTER_KEYS[key]}"
            warnings.warn(
                f"{key}= is spelt {new}= now; write {new}={path} ({key}= will be refused in the next release)",
                FutureWarning,
                stacklevel=2,
            )
            key = new
        if not (sep and key.startswith("drafter.")):
            rest.append(arg)
            continue
        kind = key.removeprefix("drafter.")
        if kind not in KIND_MODULES:
            raise OverrideError(
                f"{key}={path}: unknown drafter kind '{kind}'; write drafter.KIND=PATH with KIND one "
                f"of {', '.join(KIND_MODULES)} (or drafter=PATH: the kind its export records)"
            )
        by_kind[kind] = path
    return rest, by_kind


def drafter_paths(cfg: Any) -> dict[str, str]:
    """Drafter kind (``core.drafters.kinds``) -> path: ``drafters=DIR`` first (each export by the kind it records),
    then ``drafter=PATH`` (by the kind its export records; a draft LM otherwise), then each ``drafter.<kind>=PATH``
    on top; H-RAD's ``hrad=PATH`` too."""
    paths: dict[str, str] = {}
    if cfg.drafters:
        paths.update({kind: str(path) for kind, path in find_exports(cfg.drafters).items()})
    if cfg.drafter:
        paths[export_kind(Path(cfg.drafter)) or CAUSAL_LM_KIND] = cfg.drafter
    paths.update(getattr(cfg, "drafter_by_kind", None) or {})
    if cfg.specbranch.hrad not in ("auto", "none"):
        paths["hrad"] = cfg.specbranch.hrad
    return paths


def drafter_kind_for(interface: str, available: Iterable[str]) -> str | None:
    """Which of the ``available`` drafter kinds an algorithm written for kind ``interface`` runs with: that kind
    itself, else the first that serves as it (``EngineKind.serves_as``); None when none does."""
    available = list(available)
    if interface in available:
        return interface
    return next((kind for kind in available if kind in KIND_MODULES and engine_kind(kind).interface == interface), None)


def check_drafters(labels: Sequence[str], available: set[str], drafter: str | None = None) -> None:
    """Refuse (one line) algorithm labels whose drafter kind is not ``available``, naming the key that adds it;
    ``drafter`` (the ``drafter=`` path, routed by the kind its export records) is named when it is another kind."""
    missing = {label: algorithm_class(parse_variant(label)[0]).drafter for label in labels}
    missing = {
        label: kind for label, kind in missing.items() if kind != "none" and drafter_kind_for(kind, available) is None
    }
    if missing:
        first, kind = next(iter(missing.items()))
        needs = engine_kind(kind).needs
        option = "drafter" if kind == CAUSAL_LM_KIND else f"drafter.{kind}"
        given = export_kind(Path(drafter)) if drafter else None
        if given is not None and given != kind:
            raise OverrideError(
                f"'{first}' needs {needs}, but drafter={drafter} is a {given} export (its config.json "
                f"says so); give {option}=PATH or choose an algorithm for it"
            )
        raise OverrideError(
            f"algorithms {list(missing)} need a drafter: '{first}' needs {needs}; add {option}=PATH or "
            "drafters=DIR (a directory of exports)"
        )


def load_target(cfg: Any, max_batch_size: int = 1) -> LoadedModel:
    return load_lm(
        cfg.target,
        device=cfg.device,
        max_seq_len=cfg.max_seq_len,
        max_batch_size=max_batch_size,
        dtype=model_dtype(cfg.dtype, pick_device(cfg.device)),
        chat_template=cfg.chat_template,
    )


def load_drafters(
    cfg: Any,
    paths: dict[str, str],
    needed: set[str],
    target: LoadedModel,
    preloaded: dict[str, Any],
    max_batch_size: int = 1,
) -> dict[str, Any]:
    """The drafter for each ``needed`` algorithm drafter kind (an algorithm's ``drafter``), by the available kind
    that serves it (:func:`drafter_kind_for`): the preloaded one if given, else loaded from its path."""
    drafters = {}
    for interface in needed:
        kind = drafter_kind_for(interface, [*preloaded, *paths])
        drafters[interface] = (
            preloaded[kind]
            if preloaded.get(kind) is not None
            else load_drafter(
                kind, paths[kind], target, device=cfg.device, max_seq_len=cfg.max_seq_len, max_batch_size=max_batch_size
            )
        )
    return drafters


def resolved_config(cfg: Any, paths: dict[str, str]) -> Any:
    """``cfg`` with the draft LM's path and H-RAD resolved: algorithms that rebuild a drafter elsewhere (a draft
    process) read its path from cfg, and ``specbranch.hrad=auto`` means the drafters' H-RAD export, if any."""
    hrad = cfg.specbranch.hrad
    return OmegaConf.merge(
        OmegaConf.structured(cfg) if not OmegaConf.is_config(cfg) else cfg,
        {
            "drafter": paths.get(CAUSAL_LM_KIND),
            "specbranch": {"hrad": paths.get("hrad", "none") if hrad == "auto" else hrad},
        },
    )


def engine_context(cfg: Any, target: LoadedModel, names: Iterable[str]) -> dict[str, Any]:
    """What the engine hands an algorithm besides its options, by the names its ``context`` lists: the draft LM's
    path (a draft process reloads it), the run's seed and threads, the target's tokenizer (Self-Draft checks its
    corpus against it), and the round observer ``adapt=`` names with its settings (parsed by the observer)."""
    sources = {
        "draft_path": lambda: cfg.drafter,
        "seed": lambda: 0 if cfg.seed is None else cfg.seed,  # a server may leave seed unset
        "threads": lambda: cfg.threads,
        "tokenizer": lambda: target.tokenizer,
        "adapt": lambda: cfg.adapt,
        "adapt_settings": lambda: (
            observer_kind(cfg.adapt).settings(dict(cfg.adapt_settings)) if cfg.adapt != "none" else None
        ),
    }
    return {name: sources[name]() for name in names}


def build_variant(
    label: str, resolved: Any, target: LoadedModel, drafters: dict[str, Any], limited: dict[int, Any]
) -> tuple[Any, Any]:
    """``(algorithm, its config)`` for ``NAME[@key=value...]`` over the loaded target and drafters; ``limited``
    caches one vocabulary-limited draft runner (shared weights) per ``draft_vocab``."""
    name, overrides = parse_variant(label)
    variant_cfg = with_overrides(resolved, overrides, label)
    if variant_cfg.specbranch.hrad == "auto":  # as for the run: the drafters' H-RAD export, if any
        variant_cfg.specbranch.hrad = resolved.specbranch.hrad
    cls = algorithm_class(name)
    options = OmegaConf.to_object(variant_cfg[name])
    drafter = drafters.get(cls.drafter)
    if cls.drafter == CAUSAL_LM_KIND and options.draft_vocab:
        vocab = options.draft_vocab
        drafter = limited.setdefault(vocab, with_logit_vocab(drafter, vocab))
    context = engine_context(variant_cfg, target, cls.context)
    return build_algorithm(name, target.runner, drafter, options, **context), variant_cfg


def build_algorithms(
    cfg: Any,
    labels: Sequence[str],
    target: LoadedModel | None = None,
    preloaded: dict[str, Any] | None = None,
    max_batch_size: int = 1,
) -> tuple[LoadedModel, dict[str, tuple[Any, Any]]]:
    """Load (or take) the target and the drafters ``labels`` need, and build each label: ``(target, {label:
    (algorithm, its config)})``. ``preloaded`` maps a drafter kind (``core.drafters.kinds``) to an already loaded
    drafter."""
    paths = drafter_paths(cfg)
    preloaded = {kind: obj for kind, obj in (preloaded or {}).items() if obj is not None}
    check_drafters(labels, set(preloaded) | set(paths), cfg.drafter)
    target = target or load_target(cfg, max_batch_size)
    needed = {algorithm_class(parse_variant(label)[0]).drafter for label in labels} - {"none"}
    drafters = load_drafters(cfg, paths, needed, target, preloaded, max_batch_size)
    resolved, limited = resolved_config(cfg, paths), {}
    return target, {label: build_variant(label, resolved, target, drafters, limited) for label in labels}
