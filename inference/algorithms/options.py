"""Each algorithm's own options, and the options every algorithm shares (sampling, placement).

An algorithm's options dataclass is the only place its options and their defaults are written: the algorithm takes
it whole (``SSD(target, draft, SSDOptions(budget=16))``, or its fields as keywords), and the CLIs read it under the
algorithm's name (``ssd.budget=16``; in a variant ``ssd@budget=16``). ``inference.engine_args.check_algorithm_options``
refuses a key the chosen algorithms do not read, or one that does nothing under the others' values
(:data:`ONLY_WITH`), so an option is never accepted and silently ignored. The CLIs parse into
:class:`AlgorithmOptions`, one section per algorithm. The dataclasses live here, not beside each algorithm, so parsing
a command line imports no algorithm.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

import torch


# ---------------------------------------------------------------------------------------------------------------
# Groups several algorithms share


@dataclass
class ChainOptions:
    gamma: int = 4  # draft tokens per round
    # the draft proposes only from the K lowest token ids, so its lm_head costs K/V of the full one (lossless;
    # inference.runner_loading.with_logit_vocab); 0 = every id
    draft_vocab: int = 0


@dataclass
class OverlapOptions:
    executor: str = "sequential"  # sequential | cuda_streams | multiprocess (inference.executors)


# ---------------------------------------------------------------------------------------------------------------
# One dataclass per algorithm (inference.algorithms.ALGORITHMS names them)


@dataclass
class AROptions:
    """AR reads no algorithm option."""


@dataclass
class SpsOptions(ChainOptions):
    verifier: str = "tokenwise"  # tokenwise | block | hsd
    final_ratio: str = "capped"  # capped (lossless) | uncapped (the HSD authors' lossy rule); verifier=hsd only


@dataclass
class PearlOptions(ChainOptions, OverlapOptions):
    pass


@dataclass
class SpecBranchOptions(ChainOptions, OverlapOptions):
    # H-RAD export PATH; none = confidence cut every round ("w/o H-RAD"); auto = the H-RAD export of evaluate's
    # drafters=DIR when there is one, else none; measurement policies (inference.algorithms.specbranch.POLICIES):
    # class0 / class2 = that class every round, oracle = the true class, oracle_keep = exactly the accepted
    # continuation (both oracles: one extra greedy target pass per surviving branch, temperature=0 only)
    hrad: str = "auto"
    kmax: int = 3  # most branches per branch point; 1 = "w/o branching"
    epsilon: float | None = None  # confidence threshold ε; None = the H-RAD export's, else 0.3
    # first continuation token the confidence rule (class 1) checks: 2 = the authors' code (keeps at least one);
    # 1 = it may keep none, so a low-confidence first continuation token is not bet on
    cut_from: int = 2


@dataclass
class SSDOptions(ChainOptions, OverlapOptions):
    """Lookahead K = gamma (docs/algorithms/ssd.md)."""

    budget: int = 8  # B: cached speculations per sequence per round
    # geometric (closed form, a_p by EMA) | uniform (B / (K+1) each: the reference's shape, e.g. ssd.gamma=7
    # ssd.budget=24) | K+1 ints, e.g. "2:2:2:1:1"
    fanout: str = "geometric"
    fanout_miss: str = "auto"  # auto (JIT: = hit vector; fast: geometric on fast acceptance) | uniform | K+1 ints
    fanout_r: float = 1.0  # power-law exponent r of the cache-miss model
    fallback: str = "jit"  # jit (drafter drafts on a miss) | fast (n-gram/random tokens) | auto (batch-aware)
    fast: str = "ngram"  # ngram | random: the fast fallback's tokens
    saguaro_c: float = 1.0  # SAGUARO C in (0, 1]: scale of the cached guesses' draft probability
    # where the fork guesses come from with draft_vocab set: full (the drafter's whole lm_head at the K+1 fork
    # positions, so a bonus id >= draft_vocab can hit) | draft (the limited head: such a bonus always misses)
    fork_vocab: str = "full"


@dataclass
class Eagle3TreeOptions:
    tree_depth: int = 6  # longest drafted path
    tree_topk: int = 8  # children per expanded node, and nodes expanded per level
    tree_total: int = 48  # tokens per verification forward, root included


@dataclass
class SpecBlockTreeOptions:
    """docs/algorithms/specblock.md §6: the released defaults."""

    width: int = 10  # W: block-1 slot-0 width; leaf beam for rounds after block 2
    budget: int = 90  # N: tree nodes, root excluded
    widths: list[int] | None = None  # TOPK[rank bucket]; None = the drafter's ([2, 4, 6, 4])
    blocks: int = 2  # N_blk_inf: blocks per tree
    prob_caps: bool = True  # confidence caps on the widths


@dataclass
class SelfDraftOptions:
    """The paper's defaults (L = N = 6, G = 4, 10 context + 2-3 corpus candidates; docs/algorithms/self_draft.md)."""

    branch_len: int = 6  # branch length L (draft levels per branch = L - 2)
    branch_num: int = 6  # number of draft branches N
    gram_len: int = 4  # context gram length G (capped at L - 1)
    ctx_candidates: int = 10  # context-cache candidates per step
    corpus_candidates: int = 3  # corpus-cache candidates per step (with a corpus)
    verify_branches: bool = True  # also accept tokens from the branches (lossless; off under compat_original_cap)
    grid_vocab: int = 0  # grid argmax over the K lowest ids + the text's tokens (CPU); 0 = all
    corpus: str | None = None  # corpus cache file from python -m data_prep.ngram_corpus (or a CorpusCache)
    compat_original_cap: bool = False  # the original's counting (no bonus token), for the paper's DE


@dataclass
class DFlashOptions:
    draft_tokens: int = 0  # tokens drafted (and verified) per round, 1..block_size - 1; 0 = the whole block


@dataclass
class PEagleOptions:
    draft_tokens: int = 0  # tokens drafted (and verified) per round, 1..num_depths; 0 = all of them


OPTIONS_BY_ALGORITHM: dict[str, type] = {
    "ar": AROptions,
    "sps": SpsOptions,
    "eagle3_tree": Eagle3TreeOptions,
    "self_draft": SelfDraftOptions,
    "pearl": PearlOptions,
    "specbranch": SpecBranchOptions,
    "specblock_tree": SpecBlockTreeOptions,
    "ssd": SSDOptions,
    "dflash": DFlashOptions,
    "peagle": PEagleOptions,
}
ADAPTABLE = ("eagle3_tree", "specblock_tree")  # the algorithms that take adapt= (a round observer, adapt.NAME=...)

Options = TypeVar("Options")


def with_fields(options_type: type[Options], options: Options | None, overrides: Mapping[str, Any]) -> Options:
    """``options`` (None: ``options_type``'s defaults) with ``overrides`` (field name -> value) on top: how an
    algorithm's constructor takes its options whole or as keywords. An unknown name fails in one line."""
    names = [f.name for f in fields(options_type)]
    unknown = [key for key in overrides if key not in names]
    if unknown:
        raise TypeError(
            f"{options_type.__name__} has no option {', '.join(unknown)}; its options: {', '.join(names) or 'none'}"
        )
    return replace(options if options is not None else options_type(), **overrides)


def option_keys(algorithm: str) -> list[str]:
    """The options ``algorithm`` reads, in declaration order (each is the CLI key ``algorithm.NAME``)."""
    return [f.name for f in fields(OPTIONS_BY_ALGORITHM[algorithm])]


ALGORITHM_KEYS = frozenset(f"{name}.{key}" for name in OPTIONS_BY_ALGORITHM for key in option_keys(name))

# The flat spellings of the release before scoped keys, accepted for one release with a warning naming the new one:
# a shared name sets that option of every algorithm that has it.
_SHARED_FLAT = ("gamma", "draft_vocab", "executor", "verifier", "hrad", "tree_depth", "tree_topk", "tree_total")
_RENAMED_FLAT = {
    "hsd_final_ratio": "sps.final_ratio",
    "specbranch_kmax": "specbranch.kmax",
    "specbranch_eps": "specbranch.epsilon",
    "specbranch_cut_from": "specbranch.cut_from",
    **{
        f"ssd_{key}": f"ssd.{key}"
        for key in ("budget", "fanout", "fanout_miss", "fanout_r", "fallback", "fast", "saguaro_c", "fork_vocab")
    },
    **{f"specblock_{key}": f"specblock_tree.{key}" for key in ("width", "budget", "widths", "blocks", "prob_caps")},
    "self_draft_L": "self_draft.branch_len",
    "self_draft_N": "self_draft.branch_num",
    "self_draft_G": "self_draft.gram_len",
    "self_draft_candidates": "self_draft.ctx_candidates",
    "self_draft_corpus_candidates": "self_draft.corpus_candidates",
    "self_draft_verify_branches": "self_draft.verify_branches",
    "self_draft_grid_vocab": "self_draft.grid_vocab",
    "ngram_corpus": "self_draft.corpus",
    "compat_original_cap": "self_draft.compat_original_cap",
    "dflash_draft_tokens": "dflash.draft_tokens",
    "peagle_draft_tokens": "peagle.draft_tokens",
}
FLAT_SPELLINGS: dict[str, tuple[str, ...]] = {
    **{
        key: tuple(f"{name}.{key}" for name in OPTIONS_BY_ALGORITHM if key in option_keys(name)) for key in _SHARED_FLAT
    },
    **{old: (new,) for old, new in _RENAMED_FLAT.items()},
}
FLAT_ADAPT_PREFIX = "adapt_"  # adapt_NAME=VALUE, now adapt.NAME=VALUE

SPECBRANCH_ORACLES = ("oracle", "oracle_keep")  # hrad= policies that read the greedy target's true class


def oracle_temperature_error(hrad: object, temperature: float) -> str | None:
    """One line if ``hrad`` is an oracle policy and ``temperature`` > 0 (the oracles read the greedy target)."""
    name = str(hrad or "").strip().lower()
    if name in SPECBRANCH_ORACLES and float(temperature) != 0:
        return (
            f"hrad={name} needs temperature=0 (the true class is the greedy target's), got "
            f"temperature={temperature}; use an H-RAD export, none, class0 or class2 at temperature > 0"
        )
    return None


def specbranch_option_error(cfg) -> str | None:
    """Why a SpecBranch configuration (an engine config with its ``specbranch`` section) cannot run, or None."""
    return oracle_temperature_error(cfg.specbranch.hrad, cfg.temperature)


@dataclass(frozen=True)
class Needs:
    """A condition under which an option takes effect: the same algorithm's option ``other`` passes ``holds``;
    ``fix`` says what to set (the refusal reads "ALGO.KEY does nothing with ALGO.OTHER=VALUE; set ALGO.FIX or drop
    ALGO.KEY")."""

    other: str
    holds: Callable[[Any], bool]
    fix: str


def _is(value: str) -> Callable[[Any], bool]:
    return lambda actual: str(actual).strip().lower() == value


def _is_not(*values: str) -> Callable[[Any], bool]:
    return lambda actual: str(actual).strip().lower() not in values


# hrad= policies that never apply the confidence rule (class 1), so neither ε nor the cut position is read
NO_CONFIDENCE_RULE = ("class0", "class2", "oracle_keep")
CONFIDENCE_RULE = Needs(
    "hrad",
    _is_not(*NO_CONFIDENCE_RULE),
    "hrad=none, oracle or an H-RAD export (class0, class2 and oracle_keep never cut by confidence)",
)

# An option (ALGORITHM.KEY) that takes effect only when every one of its conditions holds: set where one fails in
# every run that reads it, it would be ignored, so it is refused (inference.engine_args.check_algorithm_options).
ONLY_WITH: dict[str, tuple[Needs, ...]] = {
    "sps.final_ratio": (Needs("verifier", _is("hsd"), "verifier=hsd"),),
    # the fast fallback's tokens: only drawn on a miss that the fast fallback serves
    "ssd.fast": (Needs("fallback", _is_not("jit"), "fallback=fast or auto"),),
    # which head the fork guesses come from: only a vocabulary-limited drafter has two
    "ssd.fork_vocab": (Needs("draft_vocab", _is_not("0"), "draft_vocab=N (a vocabulary-limited drafter)"),),
    "self_draft.corpus_candidates": (
        Needs("corpus", lambda path: bool(path), "corpus=FILE (python -m data_prep.ngram_corpus)"),
    ),
    "specbranch.epsilon": (CONFIDENCE_RULE,),
    "specbranch.cut_from": (CONFIDENCE_RULE,),
}


# ---------------------------------------------------------------------------------------------------------------
# What every algorithm reads


@dataclass
class SamplingOptions:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class PlacementOptions:
    device: str = "auto"
    dtype: str = "auto"  # auto (fp32 on a CPU, bf16 on CUDA) | fp32 | bf16 (CPU: native bf16 only)
    max_seq_len: int = 2048
    chat_template: str = "auto"  # how prompts are rendered: auto (the tokenizer's) | none (text as is) | PATH (Jinja)
    threads: int = 0  # CPU intra-op threads; 0 = torch's default (on a shared CPU, 1 keeps timings sane)


@dataclass
class AlgorithmOptions(SamplingOptions, PlacementOptions):
    """Every algorithm's options (one section each, ``ssd.budget``), the serving-time observer, sampling and
    placement: the schema the CLIs parse into."""

    ar: AROptions = field(default_factory=AROptions)
    sps: SpsOptions = field(default_factory=SpsOptions)
    pearl: PearlOptions = field(default_factory=PearlOptions)
    specbranch: SpecBranchOptions = field(default_factory=SpecBranchOptions)
    ssd: SSDOptions = field(default_factory=SSDOptions)
    eagle3_tree: Eagle3TreeOptions = field(default_factory=Eagle3TreeOptions)
    specblock_tree: SpecBlockTreeOptions = field(default_factory=SpecBlockTreeOptions)
    self_draft: SelfDraftOptions = field(default_factory=SelfDraftOptions)
    dflash: DFlashOptions = field(default_factory=DFlashOptions)
    peagle: PEagleOptions = field(default_factory=PEagleOptions)
    # serving-time adaptation of eagle3_tree / specblock_tree: a round observer (inference.round_observers), none |
    # bandit; its settings are the observer's own (spectrain.adapt.AdaptSettings for bandit), given as adapt.NAME=VALUE
    adapt: str = "none"
    # adapt.NAME=VALUE, passed through as written (--help shows that spelling)
    adapt_settings: dict[str, str] = field(default_factory=dict, metadata={"cli": "adapt.NAME"})


def apply_threads(cfg) -> None:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
