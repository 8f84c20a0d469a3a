"""Engine arguments -> a running algorithm: what ``inference.evaluate``, ``inference.generate`` and
``inference.serve`` share (vLLM's ``EngineArgs`` -> engine is the shape).

:class:`EngineArgs` is the target, where its drafters come from, every algorithm's options, sampling and placement.
An algorithm label is ``NAME`` or a variant ``NAME@key=value[@key=value]`` that changes only what a variant may
(``VARIANT_KEYS``). :func:`check_algorithm_options` refuses an option none of the chosen algorithms reads, and
:func:`build_variant` builds a label over a loaded target and drafters.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from core.drafters.kinds import CAUSAL_LM_KIND, KIND_MODULES, engine_kind
from core.overrides import OverrideError, leaf_keys, parse_cli, resolve_key, split_key_values
from inference.algorithms import ALGORITHMS, algorithm_class, build_algorithm
from inference.algorithms.options import (ALGORITHM_KEYS, ONLY_WITH, AlgorithmOptions, Needs, SamplingOptions,
                                          option_keys, specbranch_option_error)
from inference.drafter_index import export_kind, find_exports
from inference.drafters import LoadedModel, load_drafter, load_lm, model_dtype, pick_device
from inference.runner_loading import with_logit_vocab
from inference.sampling import SamplingParams


@dataclass
class EngineArgs(AlgorithmOptions):
    """The target and where its drafters come from (``drafter_paths``), every algorithm option, sampling and
    placement, and the answer's length."""

    target: str = "smollm2"
    drafters: str | None = None  # a directory of exports (spectrain.export), found by kind
    drafter: str | None = None  # a draft LM (exported dir, HF dir or registry name), or any export (by its kind)
    # drafter.<kind>=PATH on the command line (split_drafter_args): one drafter per kind, when several run together
    drafter_by_kind: dict[str, str] = field(default_factory=dict)
    max_new_tokens: int = 128


# What a variant NAME@key=value may change: its algorithm's options, sampling and the answer's length. The rest
# (models, placement, and each CLI's own keys) is fixed for the whole run: models load once.
SAMPLING_FILTERS = ("top_k", "top_p", "seed")  # do nothing at temperature 0 (but see _sampling_unmet)
VARIANT_KEYS = ALGORITHM_KEYS | {f.name for f in fields(SamplingOptions)} | {"max_new_tokens"}


def parse_variant(label: str) -> tuple[str, list[str]]:
    """``sps@verifier=hsd@gamma=3`` -> ("sps", ["verifier=hsd", "gamma=3"])."""
    base, *overrides = label.split("@")
    for item in overrides:
        if "=" not in item:
            raise OverrideError(f"algorithm variant '{label}': '{item}' is not key=value; write NAME@key=value")
    return base, overrides


def given_keys(argv: Sequence[str], schema: type, usage: str) -> list[str]:
    """The schema keys the ``key=value`` args set (abbreviated keys resolved)."""
    valid = leaf_keys(OmegaConf.structured(schema))
    return [resolve_key(key, valid) for key, _ in split_key_values(argv, usage)]


def with_overrides(cfg: Any, overrides: Sequence[str], label: str) -> Any:
    """``cfg`` with a variant's options applied (validated against the schema, like any key=value)."""
    if not overrides:
        return cfg
    if not OmegaConf.is_config(cfg):
        cfg = OmegaConf.structured(cfg)
    keys = [k.split("=", 1)[0] for k in overrides]
    for key, item in zip(keys, overrides):
        # a key of the run's schema that a variant may not change; before parsing: a list key's value would fail
        # there with a vaguer message (an unknown key fails in parsing, with the closest valid one)
        if key in cfg and key not in VARIANT_KEYS:
            raise OverrideError(f"algorithm variant '{label}': '{key}' cannot differ per variant; "
                                f"set {item} for the whole run instead")
    try:
        variant = parse_cli(list(overrides), EngineArgs, "NAME@key=value[@key=value]")
    except OverrideError as exc:
        raise OverrideError(f"algorithm variant '{label}': {exc}") from None
    return OmegaConf.merge(cfg, {key: OmegaConf.select(variant, key) for key in keys})


def _first_unmet(key: str, cfg: Any) -> Needs | None:
    """The first condition of ``key`` (``ONLY_WITH``) that ``cfg`` does not meet, or None: it takes effect."""
    return next((need for need in ONLY_WITH.get(key, ()) if not need.holds(getattr(cfg, need.other))), None)


def _sampling_unmet(key: str, name: str, cfg: Any) -> str | None:
    """Why sampling key ``key`` does nothing for algorithm ``name`` under ``cfg`` (one clause), or None.

    At temperature 0 the output is the target's argmax, which every top-k and top-p keeps, and nothing is drawn
    from the run's generator; only SSD's fast fallback draws (its random tokens) from a generator seeded by seed."""
    if float(cfg.temperature) != 0 or (key == "top_k" and cfg.top_k == 0) or (key == "top_p" and cfg.top_p == 1):
        return None  # sampling, or a filter left off
    if key == "seed" and name == "ssd" and str(cfg.ssd_fallback) != "jit":
        return None
    return "temperature=0 (greedy: the argmax, which no top_k or top_p removes, and no random draw)"


def _check_read(given: Iterable[str], runs: Sequence[tuple[str, Any]], where: str) -> None:
    """Refuse an algorithm option in ``given`` that none of ``runs`` ((algorithm, its config) pairs) reads, or that
    does nothing in every run that reads it (``ONLY_WITH``)."""
    for key in given:
        if key not in ALGORITHM_KEYS:
            continue
        readers = [(name, cfg) for name, cfg in runs if key in option_keys(name)]
        if not readers:
            names = list(dict.fromkeys(name for name, _ in runs))
            own = "; ".join(f"{name} reads {', '.join(option_keys(name)) or 'no algorithm option'}" for name in names)
            owners = ", ".join(name for name in ALGORITHMS if key in option_keys(name))
            raise OverrideError(f"{where}{key} is not read by {', '.join(names)} ({own}); it is an option of "
                                f"{owners}: drop it or choose an algorithm that reads it")
        unmet = [_first_unmet(key, cfg) for _, cfg in readers]
        if all(need is not None for need in unmet):
            need = unmet[0]
            raise OverrideError(f"{where}{key} does nothing with {need.other}={getattr(readers[0][1], need.other)}; "
                                f"set {need.fix} or drop {key}")


def _check_sampling(given: Iterable[str], runs: Sequence[tuple[str, Any]], where: str) -> None:
    """Refuse top_k, top_p (set on) or seed in ``given`` where every run samples greedily (they would do
    nothing)."""
    for key in given:
        if key not in SAMPLING_FILTERS or not runs:
            continue
        reasons = [_sampling_unmet(key, name, cfg) for name, cfg in runs]
        if all(reasons):
            raise OverrideError(f"{where}{key} does nothing at {reasons[0]}; set temperature > 0 to sample, or "
                                f"drop {key}")


def check_algorithm_options(cfg: Any, given: Iterable[str], labels: Sequence[str], *,
                            sampling_defaults: bool = False) -> None:
    """Refuse (one line) an unknown algorithm, and an algorithm option that the run's algorithms do not read: a
    key the command line set (``given``) and each variant's own keys. ``all`` admits every option. Sampling
    filters and seed at temperature 0 are refused too, unless ``sampling_defaults`` (a server's: defaults for
    requests, which may set a temperature of their own)."""
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
        own = [item.split("=", 1)[0] for item in overrides]
        _check_read(own, [(name, variant)], f"algorithm variant '{label}': ")
        if not sampling_defaults:
            _check_sampling(own, [(name, variant)], f"algorithm variant '{label}': ")
        if name == "specbranch" and (error := specbranch_option_error(variant)):
            raise OverrideError(f"algorithm variant '{label}': {error}" if overrides else error)
        runs.append((name, variant))
    if "all" not in labels:
        _check_read(given, runs, "")
    if not sampling_defaults:
        # a run-level key is refused only if no run samples (each variant inherits it unless it sets its own)
        _check_sampling([key for key in given if key in SAMPLING_FILTERS], runs, "")


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
OLD_DRAFTER_KEYS = {"feature_drafter": "eagle3", "specblock_drafter": "specblock", "dflash_drafter": "dflash",
                    "peagle_drafter": "peagle"}


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
            warnings.warn(f"{key}= is spelt {new}= now; write {new}={path} ({key}= will be refused in the next "
                          "release)", FutureWarning, stacklevel=2)
            key = new
        if not (sep and key.startswith("drafter.")):
            rest.append(arg)
            continue
        kind = key.removeprefix("drafter.")
        if kind not in KIND_MODULES:
            raise OverrideError(f"{key}={path}: unknown drafter kind '{kind}'; write drafter.KIND=PATH with KIND one "
                                f"of {', '.join(KIND_MODULES)} (or drafter=PATH: the kind its export records)")
        by_kind[kind] = path
    return rest, by_kind


def parse_engine_cli(argv: Sequence[str], schema: type, usage: str) -> tuple[Any, list[str]]:
    """``parse_cli`` for a schema derived from :class:`EngineArgs`, with ``drafter.<kind>=PATH``: (the config, the
    arguments left for schema keys, e.g. for :func:`given_keys`)."""
    rest, by_kind = split_drafter_args(argv)
    cfg = parse_cli(rest, schema, usage)
    cfg.drafter_by_kind = by_kind
    return cfg, rest


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
    if getattr(cfg, "hrad", "auto") not in ("auto", "none"):
        paths["hrad"] = cfg.hrad
    return paths


def drafter_kind_for(interface: str, available: Iterable[str]) -> str | None:
    """Which of the ``available`` drafter kinds an algorithm written for kind ``interface`` runs with: that kind
    itself, else the first that serves as it (``EngineKind.serves_as``); None when none does."""
    available = list(available)
    if interface in available:
        return interface
    return next((kind for kind in available if kind in KIND_MODULES and engine_kind(kind).interface == interface),
                None)


def check_drafters(labels: Sequence[str], available: set[str], drafter: str | None = None) -> None:
    """Refuse (one line) algorithm labels whose drafter kind is not ``available``, naming the key that adds it;
    ``drafter`` (the ``drafter=`` path, routed by the kind its export records) is named when it is another kind."""
    missing = {label: algorithm_class(parse_variant(label)[0]).drafter for label in labels}
    missing = {label: kind for label, kind in missing.items()
               if kind != "none" and drafter_kind_for(kind, available) is None}
    if missing:
        first, kind = next(iter(missing.items()))
        needs = engine_kind(kind).needs
        option = "drafter" if kind == CAUSAL_LM_KIND else f"drafter.{kind}"
        given = export_kind(Path(drafter)) if drafter else None
        if given is not None and given != kind:
            raise OverrideError(f"'{first}' needs {needs}, but drafter={drafter} is a {given} export (its config.json "
                                f"says so); give {option}=PATH or choose an algorithm for it")
        raise OverrideError(f"algorithms {list(missing)} need a drafter: '{first}' needs {needs}; add {option}=PATH or "
                            "drafters=DIR (a directory of exports)")


def load_target(cfg: Any, max_batch_size: int = 1) -> LoadedModel:
    return load_lm(cfg.target, device=cfg.device, max_seq_len=cfg.max_seq_len, max_batch_size=max_batch_size,
                   dtype=model_dtype(cfg.dtype, pick_device(cfg.device)), chat_template=cfg.chat_template)


def load_drafters(cfg: Any, paths: dict[str, str], needed: set[str], target: LoadedModel,
                  preloaded: dict[str, Any], max_batch_size: int = 1) -> dict[str, Any]:
    """The drafter for each ``needed`` algorithm drafter kind (an algorithm's ``drafter``), by the available kind
    that serves it (:func:`drafter_kind_for`): the preloaded one if given, else loaded from its path."""
    drafters = {}
    for interface in needed:
        kind = drafter_kind_for(interface, [*preloaded, *paths])
        drafters[interface] = preloaded[kind] if preloaded.get(kind) is not None else \
            load_drafter(kind, paths[kind], target, device=cfg.device, max_seq_len=cfg.max_seq_len,
                         max_batch_size=max_batch_size)
    return drafters


def resolved_config(cfg: Any, paths: dict[str, str]) -> Any:
    """``cfg`` with the draft LM's path and H-RAD resolved: algorithms that rebuild a drafter elsewhere (a draft
    process) read its path from cfg, and ``hrad=auto`` means the drafters' H-RAD export, if any."""
    return OmegaConf.merge(OmegaConf.structured(cfg) if not OmegaConf.is_config(cfg) else cfg,
                           {"drafter": paths.get(CAUSAL_LM_KIND),
                            "hrad": paths.get("hrad", "none") if cfg.hrad == "auto" else cfg.hrad})


def build_variant(label: str, resolved: Any, target: LoadedModel, drafters: dict[str, Any],
                  limited: dict[int, Any]) -> tuple[Any, Any]:
    """``(algorithm, its config)`` for ``NAME[@key=value...]`` over the loaded target and drafters; ``limited``
    caches one vocabulary-limited draft runner (shared weights) per ``draft_vocab``."""
    name, overrides = parse_variant(label)
    variant_cfg = with_overrides(resolved, overrides, label)
    if variant_cfg.hrad == "auto":  # as for the run: the drafters' H-RAD export, if any
        variant_cfg.hrad = resolved.hrad
    kind = algorithm_class(name).drafter
    drafter = drafters.get(kind)
    if kind == CAUSAL_LM_KIND and variant_cfg.draft_vocab:
        vocab = variant_cfg.draft_vocab
        drafter = limited.setdefault(vocab, with_logit_vocab(drafter, vocab))
    return build_algorithm(name, target.runner, drafter, **algorithm_class(name).options_from_config(variant_cfg)), \
        variant_cfg


def build_algorithms(cfg: Any, labels: Sequence[str], target: LoadedModel | None = None,
                     preloaded: dict[str, Any] | None = None, max_batch_size: int = 1
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
