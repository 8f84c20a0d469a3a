"""Each algorithm's own options, and the options every algorithm shares (sampling, placement).

An algorithm's options dataclass lists exactly the keys it reads (its ``options_from_config`` reads those and the
shared ones, nothing else); ``inference.engine_args.check_algorithm_options`` refuses a key the chosen algorithms
do not read, or one that does nothing under the others' values (:data:`ONLY_WITH`), so an option is never accepted
and silently ignored. The CLIs parse into :class:`AlgorithmOptions`,
the union of them all. The dataclasses live here, not beside each algorithm, so parsing a command line imports no algorithm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

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


@dataclass
class AdaptOptions:
    """Serving-time drafter adaptation (spectrain.adapt.AdaptSettings documents each ``adapt_`` field)."""

    adapt: str = "none"  # none | bandit
    adapt_arms: str = "head,full"
    adapt_horizon: int = 1024
    adapt_prior: float = 0.3
    adapt_ucb_c: float = 0.5
    adapt_bins: int = 4
    adapt_ema: float = 0.3
    adapt_head_steps: int = 4
    adapt_head_lr: float = 1e-3
    adapt_full_steps: int = 2
    adapt_full_lr: float = 3e-4
    adapt_lora_rank: int = 8
    adapt_lora_steps: int = 2
    adapt_lora_lr: float = 1e-3
    adapt_clip: float = 1.0
    adapt_min_gap: int = 4
    adapt_patience: int = 2
    adapt_watch: int = 4
    adapt_rollback_to: str = "last"
    adapt_max_rows: int = 384
    adapt_buffer: int = 1
    adapt_validate: bool = True
    adapt_validate_on: str = "loss"
    adapt_backoff: int = 4
    adapt_origin_check: int = 4
    adapt_background: bool = False  # update on a worker thread while the next query is served (one query late)
    adapt_ttt_steps: int = 3
    adapt_teacher_temperature: float = 1.0
    adapt_step_weight: float = 0.8
    adapt_signal_floor: float = 1e-6
    adapt_cost_rows: int = 256
    adapt_cost_cache: str | None = "~/.cache/spectrain/adapt_costs.json"
    adapt_log: str | None = None  # DIR: decisions.csv + trace records for python -m spectrain.adapt.replay
    adapt_wandb: str | None = None  # wandb project for the decision log


# ---------------------------------------------------------------------------------------------------------------
# One dataclass per algorithm (inference.algorithms.ALGORITHMS names them)


@dataclass
class AROptions:
    """AR reads no algorithm option."""


@dataclass
class SpsOptions(ChainOptions):
    verifier: str = "tokenwise"  # tokenwise | block | hsd
    hsd_final_ratio: str = "capped"  # capped (lossless) | uncapped (the HSD authors' lossy rule); verifier=hsd only


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
    specbranch_kmax: int = 3  # most branches per branch point; 1 = "w/o branching"
    specbranch_eps: float | None = None  # confidence threshold ε; None = the H-RAD export's, else 0.3
    # first continuation token the confidence rule (class 1) checks: 2 = the authors' code (keeps at least one);
    # 1 = it may keep none, so a low-confidence first continuation token is not bet on
    specbranch_cut_from: int = 2


@dataclass
class SSDOptions(ChainOptions, OverlapOptions):
    """Lookahead K = gamma (docs/algorithms/ssd.md)."""

    ssd_budget: int = 8  # B: cached speculations per sequence per round
    # geometric (closed form, a_p by EMA) | uniform (B / (K+1) each: the reference's shape, e.g. gamma=7
    # ssd_budget=24) | K+1 ints, e.g. "2:2:2:1:1"
    ssd_fanout: str = "geometric"
    ssd_fanout_miss: str = "auto"  # auto (JIT: = hit vector; fast: geometric on fast acceptance) | uniform | K+1 ints
    ssd_fanout_r: float = 1.0  # power-law exponent r of the cache-miss model
    ssd_fallback: str = "jit"  # jit (drafter drafts on a miss) | fast (n-gram/random tokens) | auto (batch-aware)
    ssd_fast: str = "ngram"  # ngram | random: the fast fallback's tokens
    ssd_saguaro_c: float = 1.0  # SAGUARO C in (0, 1]: scale of the cached guesses' draft probability
    # where the fork guesses come from with draft_vocab set: full (the drafter's whole lm_head at the K+1 fork
    # positions, so a bonus id >= draft_vocab can hit) | draft (the limited head: such a bonus always misses)
    ssd_fork_vocab: str = "full"


@dataclass
class Eagle3TreeOptions(AdaptOptions):
    tree_depth: int = 6  # longest drafted path
    tree_topk: int = 8  # children per expanded node, and nodes expanded per level
    tree_total: int = 48  # tokens per verification forward, root included


@dataclass
class SpecBlockTreeOptions(AdaptOptions):
    """docs/algorithms/specblock.md §6: the released defaults."""

    specblock_width: int = 10  # W: block-1 slot-0 width; leaf beam for rounds after block 2
    specblock_budget: int = 90  # N: tree nodes, root excluded
    specblock_widths: list[int] | None = None  # TOPK[rank bucket]; None = the drafter's ([2, 4, 6, 4])
    specblock_blocks: int = 2  # N_blk_inf: blocks per tree
    specblock_prob_caps: bool = True  # confidence caps on the widths


@dataclass
class SelfDraftOptions:
    self_draft_L: int = 6  # branch length L (draft levels per branch = L - 2)
    self_draft_N: int = 6  # number of draft branches N
    self_draft_G: int = 4  # context gram length G (capped at L - 1)
    self_draft_candidates: int = 10  # context-cache candidates per step
    self_draft_corpus_candidates: int = 3  # corpus-cache candidates per step (with ngram_corpus)
    self_draft_verify_branches: bool = True  # also accept tokens from the branches (lossless)
    self_draft_grid_vocab: int = 0  # grid argmax over the K lowest ids + the text's tokens (CPU); 0 = all
    ngram_corpus: str | None = None  # corpus cache file from python -m data_prep.ngram_corpus
    compat_original_cap: bool = False  # the original's counting (no bonus token), for the paper's DE


@dataclass
class DFlashOptions:
    dflash_draft_tokens: int = 0  # tokens drafted (and verified) per round, 1..block_size - 1; 0 = the whole block


@dataclass
class PEagleOptions:
    peagle_draft_tokens: int = 0  # tokens drafted (and verified) per round, 1..num_depths; 0 = all of them


OPTIONS_BY_ALGORITHM: dict[str, type] = {
    "ar": AROptions, "sps": SpsOptions, "eagle3_tree": Eagle3TreeOptions, "self_draft": SelfDraftOptions,
    "pearl": PearlOptions, "specbranch": SpecBranchOptions, "specblock_tree": SpecBlockTreeOptions, "ssd": SSDOptions,
    "dflash": DFlashOptions, "peagle": PEagleOptions,
}

SPECBRANCH_ORACLES = ("oracle", "oracle_keep")  # hrad= policies that read the greedy target's true class


def oracle_temperature_error(hrad: object, temperature: float) -> str | None:
    """One line if ``hrad`` is an oracle policy and ``temperature`` > 0 (the oracles read the greedy target)."""
    name = str(hrad or "").strip().lower()
    if name in SPECBRANCH_ORACLES and float(temperature) != 0:
        return (f"hrad={name} needs temperature=0 (the true class is the greedy target's), got "
                f"temperature={temperature}; use an H-RAD export, none, class0 or class2 at temperature > 0")
    return None


def specbranch_option_error(cfg) -> str | None:
    """Why a SpecBranch configuration cannot run (one line), or None."""
    return oracle_temperature_error(getattr(cfg, "hrad", None), cfg.temperature)


@dataclass(frozen=True)
class Needs:
    """A condition under which an option takes effect: ``other``'s value passes ``holds``; ``fix`` says what to
    set (the refusal reads "KEY does nothing with OTHER=VALUE; set FIX or drop KEY")."""

    other: str
    holds: Callable[[Any], bool]
    fix: str


def _is(value: str) -> Callable[[Any], bool]:
    return lambda actual: str(actual).strip().lower() == value


def _is_not(*values: str) -> Callable[[Any], bool]:
    return lambda actual: str(actual).strip().lower() not in values


def _arm(arm: str) -> Needs:
    return Needs("adapt_arms", lambda arms: arm in [a.strip() for a in str(arms).split(",")],
                 f"adapt_arms with {arm} in it (e.g. adapt_arms=head,full,lora)" if arm == "lora" else
                 f"adapt_arms with {arm} in it")


ADAPT_ON = Needs("adapt", _is_not("none"), "adapt other than none")
# hrad= policies that never apply the confidence rule (class 1), so neither ε nor the cut position is read
NO_CONFIDENCE_RULE = ("class0", "class2", "oracle_keep")
CONFIDENCE_RULE = Needs("hrad", _is_not(*NO_CONFIDENCE_RULE),
                        "hrad=none, oracle or an H-RAD export (class0, class2 and oracle_keep never cut by confidence)")

# An option that takes effect only when every one of its conditions holds: set where one fails in every run that
# reads it, it would be ignored, so it is refused (inference.engine_args.check_algorithm_options).
ONLY_WITH: dict[str, tuple[Needs, ...]] = {
    "hsd_final_ratio": (Needs("verifier", _is("hsd"), "verifier=hsd"),),
    **{f.name: (ADAPT_ON,) for f in fields(AdaptOptions) if f.name != "adapt"},
    **{f.name: (ADAPT_ON, _arm(f.name.split("_")[1])) for f in fields(AdaptOptions)
       if f.name.startswith(("adapt_lora_", "adapt_head_", "adapt_full_"))},
    # the fast fallback's tokens: only drawn on a miss that the fast fallback serves
    "ssd_fast": (Needs("ssd_fallback", _is_not("jit"), "ssd_fallback=fast or auto"),),
    # which head the fork guesses come from: only a vocabulary-limited drafter has two
    "ssd_fork_vocab": (Needs("draft_vocab", _is_not("0"), "draft_vocab=N (a vocabulary-limited drafter)"),),
    "self_draft_corpus_candidates": (Needs("ngram_corpus", lambda path: bool(path),
                                           "ngram_corpus=FILE (python -m data_prep.ngram_corpus)"),),
    "specbranch_eps": (CONFIDENCE_RULE,),
    "specbranch_cut_from": (CONFIDENCE_RULE,),
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
class AlgorithmOptions(SpsOptions, PearlOptions, SpecBranchOptions, SSDOptions, Eagle3TreeOptions,
                       SpecBlockTreeOptions, SelfDraftOptions, DFlashOptions, PEagleOptions, SamplingOptions,
                       PlacementOptions):
    """Every algorithm's options, sampling and placement: the schema the CLIs parse into."""


def option_keys(algorithm: str) -> list[str]:
    """The algorithm-specific keys ``algorithm`` reads, in declaration order."""
    return [f.name for f in fields(OPTIONS_BY_ALGORITHM[algorithm])]


ALGORITHM_KEYS = frozenset(k for name in OPTIONS_BY_ALGORITHM for k in option_keys(name))


def apply_threads(cfg) -> None:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
