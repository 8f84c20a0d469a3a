"""Issue #36's GPU check in one command: losslessness, AR speed, verification cost and training on CUDA.

    python -m benchmarks.gpu_check out=DIR [cpu_dry_run=false] [sections=[lossless,ar_speed,...]] [commit=SHA]

Writes ``DIR/results.json`` (rewritten after every section, so a run cut short keeps what it measured) and
``DIR/report.md``. Each section is one function; one that fails records its error and a traceback summary and the
others still run. The models are random, built from a ``LlamaConfig`` on the device (no hub, no network): tiny
Llamas, and a ~1.2B Llama (hidden 2048, 16 layers, 32 heads, 8 kv heads, intermediate 8192, vocab 32000) with a
scaled-up lm_head (sharp outputs) and an embedding-dominated residual stream, so that its draft model, its own
first 2 layers with the same embedding and lm_head, agrees with it often (see ``Models``). EAGLE-3 and SpecBlock
drafters are random.

Sections, run in this order. Sized for under 7 minutes on one H100, but not yet timed on one: the estimate is
dominated by transformers' auto-compile, our own compile (both last in their sections) and the exact-law sampling
(bounded by ``mc_seconds`` per law).

- ``lossless``: every algorithm's greedy tokens vs AR's, fp32 and bf16, tiny and 1B: equal, the first index
  where they differ, and there the target's logit gap between AR's token and the algorithm's (a near-tie flip
  when the algorithm's token is the runner-up and the gap is under ``tie_fp32`` / ``tie_bf16`` or within twice
  the rounding noise there: see ``divergence``); the T=1 law of the first 3 tokens of SpS and eagle3_tree vs the exact target law (TV distance,
  chi-square p-value); ``executor=cuda_streams`` vs ``sequential`` for PEARL and SpecBranch; whether T=1
  generation takes a CPU generator (as ``inference.evaluate`` passes) and one on the GPU.
- ``ar_speed``: the engine's AR tokens/s on the 1B in bf16 at batch 1 vs transformers ``generate`` (dynamic
  cache; static cache eager; static cache auto-compiled, which is transformers' CUDA default) and vs the HBM
  roofline (bytes one decode step reads / the measured device-to-device copy bandwidth).
- ``verify_cost``: one forward of T = 1..64 tokens as a chain and as a random tree over 1k and 4k cached tokens,
  relative to a one-token decode step (median of ``repeats``; the cache is truncated back after each).
- ``training``: one EAGLE-3 and one SpecBlock training step of the ``*_llama8b`` recipes (their hyper-parameters,
  batch and length) on the 1B target in bf16 autocast: step time and peak memory vs ``spectrain.memory.estimate``;
  then the background adapter serving a tiny target on CUDA (its update runs on a side stream) and staying AR-equal.
- ``ar_compiled``: the engine's AR with ``ModelRunner._layers`` (embedding and decoder layers) under
  ``torch.compile`` on one runner instance (dynamic shapes: the cache length grows every step, so CUDA graphs
  would re-record per step): compile time, tokens/s, tokens vs eager.

``cpu_dry_run=true``: tiny models only (the "1B" becomes an 8-layer toy), a few tokens, fp32, on the CPU, no
compile: it checks the script end to end in seconds (``tests/benchmarks/test_gpu_check.py``). Without it the script refuses
to run without CUDA.

On the device machine: its image lacks omegaconf (every engine module imports it through ``core.overrides``),
antlr4 (omegaconf's parser) and torchdata (the training modules' data loader), all pure Python. Copy them here
once and carry the folder (``.gpu_deps/`` is git-ignored):

    mkdir -p .gpu_deps && cp -r .venv/lib/python3.11/site-packages/{omegaconf,antlr4,torchdata} .gpu_deps/
    run(command="PYTHONPATH=.:.gpu_deps python3 -m benchmarks.gpu_check out=$OUT/gpu commit=SHA",
        carry=[".gpu_deps"], timeout_s=540)

(the device's copy of the tree has no ``.git``: pass ``commit=$(git rev-parse HEAD)``'s value, or it reads unknown).
"""

from __future__ import annotations

import copy
import datetime
import gc
import itertools
import json
import math
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.config import BenchConfig, Output, Repeats, Seeded, parse_bench, run_dir
from core.drafters.dflash import DFlashConfig, DFlashDrafter
from core.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from core.drafters.hrad import HRAD, HRADConfig, HRADPredictor, capture_layers
from core.drafters.peagle import PEagleConfig, PEagleDrafter
from core.drafters.specblock import SpecBlockConfig, SpecBlockDrafter
from core.errors import UserError
from core.layer_ids import eagle3_layers, resolve_layers
from core.overrides import run_cli
from data_prep.capture import HiddenCapture
from data_prep.features import collate_features
from data_prep.samples import TokenSample
from inference.algorithms import ALGORITHMS, build_algorithm
from inference.algorithms.options import apply_threads
from inference.exactness import tree_mask
from inference.round_observers import observer_names, register_observer
from inference.runner import ModelRunner
from inference.sampling import SamplingParams
from spectrain.adapt.adapter import AdaptSettings
from spectrain.adapt.engine import BANDIT
from spectrain.config import FitConfig
from spectrain.kinds.eagle3.module import Eagle3Module, Eagle3Schema
from spectrain.kinds.specblock.module import SpecBlockModule, SpecBlockSchema
from spectrain.memory import estimate, parameter_counts

REPO = Path(__file__).resolve().parents[1]
USAGE = "python -m benchmarks.gpu_check out=DIR [cpu_dry_run=false] [sections=[lossless,ar_speed,...]] [commit=SHA]"
SECTIONS = ("lossless", "ar_speed", "verify_cost", "training", "ar_compiled")
GREEDY = SamplingParams(0.0)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DRAFT_LM = ("sps", "pearl", "specbranch", "ssd")  # algorithms whose drafter is a draft LM

# The 1B target (Llama-3.2-1B's shape with a 32k vocabulary) and, for the CPU dry run, a toy of the same layout.
BIG = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=8192,
)
TOY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=2048,
)
TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=97,
    max_position_embeddings=512,
)


@dataclass
class GpuCheckConfig(BenchConfig, Output, Seeded, Repeats):
    """``out``: the directory for results.json and report.md (default runs/gpu_check)."""

    threads: int = 0  # torch's default: the device machine's CPU is not shared
    repeats: int = 10  # timed forwards per verification-cost cell (what the recorded H100 run used)
    cpu_dry_run: bool = False  # tiny models, a few tokens, fp32, on the CPU: checks this script in seconds
    sections: list[str] = field(default_factory=lambda: list(SECTIONS))  # which to run (in SECTIONS order)
    commit: str = ""  # recorded as the git commit when set (else `git rev-parse HEAD`, else unknown)
    new_tokens: int = 64  # greedy tokens per lossless comparison
    speed_tokens: int = 256  # new tokens per timed AR generation
    mc_runs: int = 2000  # T=1 generations per exact-law check, stopped early after mc_seconds
    mc_seconds: float = 30.0
    tie_fp32: float = 1e-4  # a divergence whose top-2 logit gap is below this is a near-tie flip (fp32)
    tie_bf16: float = 0.05  # the same in bf16


@dataclass(frozen=True)
class Plan:
    """What a run does, from the config: the full sizes on CUDA, toy sizes on the CPU dry run."""

    device: torch.device
    dry: bool
    big: dict
    dtypes: tuple[str, ...]  # lossless dtypes
    new_tokens: int
    speed_tokens: int
    contexts: tuple[int, ...]  # verify_cost: cached tokens
    verify_tokens: tuple[int, ...]  # verify_cost: new tokens per forward
    repeats: int
    mc_runs: int
    mc_seconds: float
    train_len: int | None  # training: tokens per sequence (None: the recipe's max_len)

    @classmethod
    def of(cls, cfg: GpuCheckConfig) -> Plan:
        if cfg.cpu_dry_run:
            return cls(torch.device("cpu"), True, TOY, ("fp32",), 8, 16, (64,), (1, 4, 16), 2, 40, 10.0, 32)
        if not torch.cuda.is_available():
            raise UserError(
                "benchmarks.gpu_check measures CUDA: run it on a GPU, or pass cpu_dry_run=true to check "
                "the script on a CPU"
            )
        return cls(
            torch.device("cuda"),
            False,
            BIG,
            ("fp32", "bf16"),
            cfg.new_tokens,
            cfg.speed_tokens,
            (1024, 4096),
            (1, 4, 16, 48, 64),
            cfg.repeats,
            cfg.mc_runs,
            cfg.mc_seconds,
            None,
        )


# -- models ------------------------------------------------------------------------------------------------------


def random_llama(
    seed: int,
    shape: dict,
    *,
    logit_scale: float,
    device: torch.device,
    embed_scale: float = 1.0,
    residual_scale: float = 1.0,
) -> LlamaForCausalLM:
    """A random Llama (untied lm_head, no EOS: generations always run to their budget) with its lm_head scaled by
    ``logit_scale`` (sharper output distributions: fewer near-ties), its embedding by ``embed_scale`` and what each
    layer writes into the residual stream (o_proj, down_proj) by ``residual_scale``."""
    torch.manual_seed(seed)
    config = LlamaConfig(**shape, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
        model.model.embed_tokens.weight.mul_(embed_scale)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(residual_scale)
            layer.mlp.down_proj.weight.mul_(residual_scale)
    return model.eval().requires_grad_(False)


def first_layers(model: LlamaForCausalLM, layers: int) -> LlamaForCausalLM:
    """A draft model: ``model``'s first ``layers`` decoder layers with its embedding, final norm and lm_head."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    with torch.device(model.device):
        draft = LlamaForCausalLM(config)
    draft.load_state_dict(model.state_dict(), strict=False)
    return draft.to(model.dtype).eval().requires_grad_(False)


def vocab_subset(drafter, vocab: int, draft_vocab: int):
    """Give ``drafter`` a random reduced vocabulary of ``draft_vocab`` of the target's ``vocab`` ids."""
    if draft_vocab < vocab:
        used = torch.sort(torch.randperm(vocab)[:draft_vocab]).values
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[used] = True
        drafter.set_vocab_map(used - torch.arange(draft_vocab), t2d)
    return drafter.eval()


def random_eagle3(target: LlamaForCausalLM, draft_vocab: int, seed: int = 3) -> Eagle3Drafter:
    """A random EAGLE-3 drafter over a random reduced vocabulary (tests/inference/test_eagle3_tree.py random_drafter)."""
    config = Eagle3Config.for_target(target.config, draft_vocab_size=draft_vocab, aux_layer_ids=aux_layers(target))
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(config, embed_weight=target.get_input_embeddings().weight.detach().float().cpu())
    return vocab_subset(drafter, target.config.vocab_size, draft_vocab).to(target.device, target.dtype)


def random_specblock(target: LlamaForCausalLM, draft_vocab: int, seed: int = 3) -> SpecBlockDrafter:
    """A random SpecBlock drafter (tests/inference/test_specblock_tree.py random_drafter)."""
    config = SpecBlockConfig.for_target(
        target.config, draft_vocab_size=draft_vocab, aux_layer_ids=aux_layers(target), block_size=4
    )
    torch.manual_seed(seed)
    drafter = SpecBlockDrafter(config, embed_weight=target.get_input_embeddings().weight.detach().float().cpu())
    return vocab_subset(drafter, target.config.vocab_size, draft_vocab).to(target.device, target.dtype)


def random_dflash(target: LlamaForCausalLM, draft_vocab: int, seed: int = 3) -> DFlashDrafter:
    """A random DFlash drafter (blocks of 4, one layer) over the target's frozen embedding and head rows."""
    config = DFlashConfig.for_target(
        target.config,
        draft_vocab_size=draft_vocab,
        aux_layer_ids=aux_layers(target),
        block_size=4,
        num_layers=1,
        mask_token_id=0,
    )
    torch.manual_seed(seed)
    drafter = DFlashDrafter(
        config,
        embed_weight=target.get_input_embeddings().weight.detach().float().cpu(),
        head_weight=target.get_output_embeddings().weight.detach().float().cpu(),
    )
    return vocab_subset(drafter, target.config.vocab_size, draft_vocab).to(target.device, target.dtype)


def random_peagle(target: LlamaForCausalLM, draft_vocab: int, seed: int = 3) -> PEagleDrafter:
    """A random P-EAGLE drafter (4 tokens per forward) over a random reduced vocabulary."""
    config = PEagleConfig.for_target(
        target.config, draft_vocab_size=draft_vocab, aux_layer_ids=aux_layers(target), mask_token_id=0, num_depths=4
    )
    torch.manual_seed(seed)
    drafter = PEagleDrafter(config, embed_weight=target.get_input_embeddings().weight.detach().float().cpu())
    return vocab_subset(drafter, target.config.vocab_size, draft_vocab).to(target.device, target.dtype)


def aux_layers(target: LlamaForCausalLM) -> list[int]:
    layers = target.config.num_hidden_layers
    return eagle3_layers(layers) if layers >= 8 else [0, 1, 2]


def runner_for(model: LlamaForCausalLM, max_seq_len: int, **kw) -> ModelRunner:
    """A runner in the model's own dtype and device: it shares the weights, no copy."""
    return ModelRunner.from_hf_model(model, dtype=model.dtype, max_seq_len=max_seq_len, **kw)


class Models:
    """The run's models, built on first use and kept: the 1B target (and its 2-layer draft) per dtype, tiny ones.

    The 1B's residual stream is dominated by its embedding (x50) over what its layers write (x0.05): its first 2
    layers then agree with it on 77 % of the next tokens of random text, and its embedding alone on 72 % (measured
    on a CPU; at x0.3 they agree on 9 %, with transformers' init on none, so every draft would be rejected), while
    its layers still decide more than 1 token in 4, so a cache, mask or position bug still changes the output."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self._cache: dict[tuple[str, str], LlamaForCausalLM] = {}

    def get(self, name: str, dtype: str = "fp32") -> LlamaForCausalLM:
        """``big`` / ``tiny`` targets, ``big_draft`` / ``tiny_draft`` (their first 2 layers), in ``dtype``."""
        key = (name, dtype)
        if key not in self._cache:
            if dtype != "fp32":
                model = copy.deepcopy(self.get(name)).to(DTYPES[dtype])
            elif name.endswith("_draft"):
                model = first_layers(self.get(name.removesuffix("_draft")), 2)
            else:
                model = (
                    random_llama(
                        0,
                        self.plan.big,
                        logit_scale=10.0,
                        embed_scale=50.0,
                        residual_scale=0.05,
                        device=self.plan.device,
                    )
                    if name == "big"
                    else random_llama(0, TINY, logit_scale=8.0, device=self.plan.device)
                )
            self._cache[key] = model
        return self._cache[key]

    def keep_only(self, *keys: tuple[str, str]) -> None:
        """Free every model but ``keys`` ((name, dtype) pairs), so later peak-memory readings measure less else."""
        for key in [k for k in self._cache if k not in keys]:
            del self._cache[key]
        free_memory(self.plan.device)


# -- helpers -----------------------------------------------------------------------------------------------------


def free_memory(device: torch.device) -> None:
    """Give a finished section's GPU memory back before the next (on a CPU dry run there is nothing to give back,
    and a full collection of a large heap costs a few hundred milliseconds per call)."""
    if device.type == "cuda":
        gc.collect()  # runners and drafters of finished algorithms may sit in reference cycles
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where the two token lists differ (a length difference counts), None when equal."""
    index = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return index if index is not None or len(a) == len(b) else min(len(a), len(b))


def logits_after(runner: ModelRunner, prompt: list[int], prefix: list[int], *, stepwise: bool) -> torch.Tensor:
    """The target's next-token logits after ``prompt + prefix``: the prompt prefilled, then ``prefix`` one token per
    forward as AR computes it (``stepwise``) or as one chain forward, as a verification computes it."""
    runner.reset(1)
    device = runner.device
    logits = runner.forward(torch.tensor([prompt], device=device), only_last_logits=True).logits[0, -1]
    if prefix and stepwise:
        for token in prefix:
            logits = runner.forward(torch.tensor([[token]], device=device)).logits[0, -1]
    elif prefix:
        logits = runner.forward(torch.tensor([prefix], device=device), only_last_logits=True).logits[0, -1]
    return logits.float()


def divergence(
    runner: ModelRunner, prompt: list[int], reference: list[int], tokens: list[int], index: int, tie: float
) -> dict:
    """What the target says where an algorithm left AR's tokens: the logit gap between AR's token and the
    algorithm's, the algorithm's token's rank, and the rounding noise there (how much those two logits move between
    the stepwise and the chain computation). A near-tie flip: a gap below ``tie`` or within twice that noise."""
    if index >= min(len(tokens), len(reference)):
        return {"near_tie_flip": False, "note": f"lengths differ: {len(tokens)} vs AR's {len(reference)}"}
    ar_token, token = reference[index], tokens[index]
    stepwise = logits_after(runner, prompt, reference[:index], stepwise=True)
    chain = logits_after(runner, prompt, reference[:index], stepwise=False)
    gap = float(stepwise[ar_token] - stepwise[token])
    noise = float((stepwise - chain)[[ar_token, token]].abs().max())
    rank = int((stepwise > stepwise[token]).sum())  # 0 = the top token
    top = torch.topk(stepwise, 2).values
    return {
        "gap": round(gap, 5),
        "rank": rank,
        "noise": round(noise, 5),
        "top2_gap": round(float(top[0] - top[1]), 5),
        "near_tie_flip": rank <= 1 and gap <= max(tie, 2 * noise),
    }


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - start


def random_tree(nodes: int, seed: int) -> list[int]:
    """Parents of a random draft tree of ``nodes`` nodes: node 0 is the root, each later node hangs below an
    earlier one, preferring recent nodes (deep, bushy trees like EAGLE's)."""
    rng = torch.Generator().manual_seed(seed)
    return [-1] + [int(torch.randint(max(0, i - 4), i, (1,), generator=rng)) for i in range(1, nodes)]


def chi2_p_value(chi2: float, dof: int) -> float:
    """Upper tail of the chi-square law (Wilson-Hilferty normal approximation; no scipy on the device)."""
    if dof <= 0:
        return 1.0
    z = ((chi2 / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


# -- section 1: lossless -----------------------------------------------------------------------------------------


def build_for(name: str, models: Models, model: str, dtype: str, max_seq_len: int, **options):
    """``name`` over a fresh target runner, with the drafter kind it needs (as tests/inference/test_exact_mode.py
    test_every_algorithm_equals_ar_in_exact_mode gives them)."""
    target = models.get(model, dtype)
    drafter = None
    if name in DRAFT_LM:
        drafter = runner_for(models.get(f"{model}_draft", dtype), max_seq_len)
    if name == "specbranch":
        config = target.config
        hrad = HRAD(HRADConfig(hidden_size=config.hidden_size, last_k=4, gamma=4, boundaries=[1, 3]))
        options.setdefault(
            "hrad",
            HRADPredictor(hrad, {"layers": {"ids": capture_layers(config.num_hidden_layers, 4)}}).to(target.device),
        )
    if name == "eagle3_tree":
        drafter = random_eagle3(target, draft_vocab=min(8000, target.config.vocab_size // 2))
        options.setdefault("tree_total", 16)
    if name == "specblock_tree":
        drafter = random_specblock(target, draft_vocab=min(8000, target.config.vocab_size // 2))
    if name == "dflash":
        drafter = random_dflash(target, draft_vocab=min(8000, target.config.vocab_size // 2))
    if name == "peagle":
        drafter = random_peagle(target, draft_vocab=min(8000, target.config.vocab_size // 2))
    return build_algorithm(name, runner_for(target, max_seq_len), drafter, **options)


def greedy_equality(
    plan: Plan, cfg: GpuCheckConfig, models: Models, model: str, dtype: str, prompt: list[int], new_tokens: int
) -> list[dict]:
    """One row per algorithm: its greedy tokens vs AR's, and at a divergence the target's top-2 gap there."""
    max_seq_len = len(prompt) + new_tokens + 256  # room for the largest lookahead (self_draft's grid: 107)
    reference = (
        build_for("ar", models, model, dtype, max_seq_len)
        .generate(prompt, max_new_tokens=new_tokens, sampling=GREEDY)
        .tokens
    )
    tie = cfg.tie_bf16 if dtype == "bf16" else cfg.tie_fp32

    def compare(name: str) -> dict:
        result = build_for(name, models, model, dtype, max_seq_len).generate(
            prompt, max_new_tokens=new_tokens, sampling=GREEDY, generator=torch.Generator()
        )
        diverged = first_divergence(result.tokens, reference)
        row = {"equal": diverged is None, "first_divergence": diverged, "tau": round(result.stats.tau, 3)}
        if diverged is not None:
            row.update(
                divergence(
                    runner_for(models.get(model, dtype), max_seq_len), prompt, reference, result.tokens, diverged, tie
                )
            )
        return row

    return [
        attempt({"model": model, "dtype": dtype, "algorithm": name}, compare, name)
        for name in ALGORITHMS
        if name != "ar"
    ]


@torch.no_grad()
def exact_target_law(model: LlamaForCausalLM, prompt: list[int], n: int) -> dict[tuple[int, ...], float]:
    """P(first n new tokens = s) under the target at T=1, by enumeration over V^n (fp64 softmax on the CPU)."""
    model = copy.deepcopy(model).float().cpu()
    law = {}
    for seq in itertools.product(range(model.config.vocab_size), repeat=n):
        probs = model(torch.tensor([prompt + list(seq)])).logits[0].double().softmax(-1)
        law[seq] = math.prod(float(probs[len(prompt) - 1 + i, t]) for i, t in enumerate(seq))
    return law


def sampled_law_check(
    plan: Plan, name: str, target: LlamaForCausalLM, drafter, prompt: list[int], n: int, options: dict
) -> dict:
    """T=1 generations of ``name`` until ``mc_runs`` or ``mc_seconds``: the first ``n`` tokens' empirical law vs the
    exact one (TV distance, chi-square p-value; TV of direct sampling with as many draws, for scale)."""
    law = exact_target_law(target, prompt, n)
    gpu_target = copy.deepcopy(target).to(plan.device)
    algorithm = build_algorithm(name, runner_for(gpu_target, 16), drafter, **options)
    generator = torch.Generator(device=plan.device).manual_seed(1234)  # the engine samples on the target's device
    counts: dict[tuple[int, ...], int] = {}
    accepted, runs, start = 0, 0, time.perf_counter()
    while runs < plan.mc_runs and time.perf_counter() - start < plan.mc_seconds:
        result = algorithm.generate(prompt, max_new_tokens=n, sampling=SamplingParams(1.0), generator=generator)
        counts[tuple(result.tokens)] = counts.get(tuple(result.tokens), 0) + 1
        accepted += result.stats.accepted_draft_tokens
        runs += 1
    chi2, dof = chi_square(counts, law, runs)
    tv = 0.5 * sum(abs(counts.get(s, 0) / runs - p) for s, p in law.items())
    direct_tv = 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * runs)) for p in law.values())  # E|N(0, p(1-p)/N)|
    return {
        "tokens": n,
        "runs": runs,
        "seconds": round(time.perf_counter() - start, 1),
        "accepted_draft_tokens_per_run": round(accepted / runs, 3),
        "tv": round(tv, 4),
        "direct_sampling_tv": round(direct_tv, 4),
        "chi2": round(chi2, 1),
        "dof": dof,
        "p_value": round(chi2_p_value(chi2, dof), 4),
    }


def chi_square(counts: dict, law: dict, runs: int, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom, outcomes expected fewer than ``min_expected`` times pooled
    into one cell (where the chi-square law would not hold for them alone)."""
    cells, rare_count, rare_p = [], 0, 0.0
    for outcome, p in law.items():
        if runs * p < min_expected:
            rare_count, rare_p = rare_count + counts.get(outcome, 0), rare_p + p
        else:
            cells.append((counts.get(outcome, 0), p))
    if rare_p > 0:
        cells.append((rare_count, rare_p))
    return sum((c - runs * p) ** 2 / (runs * p) for c, p in cells), len(cells) - 1


def exact_law(plan: Plan) -> list[dict]:
    """SpS and eagle3_tree at T=1 on a vocabulary-4 target (tests/inference/test_algorithms.py, tests/inference/test_eagle3_tree.py)."""
    shape = dict(TINY, vocab_size=4, num_hidden_layers=3)
    target = random_llama(10, shape, logit_scale=3.0, device=torch.device("cpu"))
    draft = random_llama(11, dict(shape, num_hidden_layers=1), logit_scale=3.0, device=plan.device)
    config = Eagle3Config.for_target(target.config, draft_vocab_size=3, aux_layer_ids=[0, 1, 2])
    torch.manual_seed(5)
    eagle = Eagle3Drafter(config, embed_weight=target.model.embed_tokens.weight.detach())
    eagle.set_vocab_map(torch.tensor([0, 0, 1]), torch.tensor([True, True, False, True]))  # ids 0, 1, 3
    prompt = [1, 2]
    cases = [
        ("sps", runner_for(draft, 16), {"gamma": 2}),
        ("eagle3_tree", eagle.eval().to(plan.device), {"tree_depth": 2, "tree_topk": 2, "tree_total": 4}),
    ]
    return [
        attempt({"algorithm": name}, sampled_law_check, plan, name, target, drafter, prompt, 3, options)
        for name, drafter, options in cases
    ]


def executor_equality(plan: Plan, models: Models) -> list[dict]:
    """``executor=cuda_streams`` vs ``sequential`` for the draft-side algorithms: greedy on both targets, and T=1
    with seeded generators on the tiny one (each side draws from its own generator, so these match too). Greedy
    runs get a CPU generator, as ``inference.evaluate`` gives them; T=1 runs one on the target's device, where the
    engine samples."""
    cases = [("tiny", "fp32", GREEDY), ("tiny", "fp32", SamplingParams(1.0)), ("big", plan.dtypes[-1], GREEDY)]

    def compare(name: str, model: str, dtype: str, sampling: SamplingParams) -> dict:
        prompt = random_ids(24, models.get(model).config.vocab_size, 7)
        outputs = {}
        for executor in ("sequential", "cuda_streams"):
            algorithm = build_for(name, models, model, dtype, 24 + plan.new_tokens + 32, executor=executor)
            generator = torch.Generator(device="cpu" if sampling.greedy else plan.device).manual_seed(99)
            try:
                outputs[executor] = algorithm.generate(
                    prompt, max_new_tokens=plan.new_tokens, sampling=sampling, generator=generator
                ).tokens
            finally:
                algorithm.close()
        return {
            "equal": outputs["sequential"] == outputs["cuda_streams"],
            "first_divergence": first_divergence(outputs["sequential"], outputs["cuda_streams"]),
        }

    return [
        attempt(
            {"algorithm": name, "model": model, "dtype": dtype, "temperature": sampling.temperature},
            compare,
            name,
            model,
            dtype,
            sampling,
        )
        for name in ("pearl", "specbranch")
        for model, dtype, sampling in cases
    ]


def generator_devices(plan: Plan, models: Models) -> list[dict]:
    """Which generator device T=1 generation accepts on this device: ``inference.evaluate`` passes a CPU one, the
    engine samples on the target's device, and a draft side seeds itself from the generator on the CPU
    (``inference.draft_side``). On CUDA one of the two may fail; on the CPU both must work."""

    def generate(name: str, device: str) -> dict:
        algorithm = build_for(name, models, "tiny", "fp32", 96)
        try:
            tokens = algorithm.generate(
                [1, 2, 3],
                max_new_tokens=8,
                sampling=SamplingParams(1.0),
                generator=torch.Generator(device=device).manual_seed(0),
            ).tokens
        finally:
            getattr(algorithm, "close", lambda: None)()
        return {"ok": len(tokens) == 8}

    return [
        attempt({"algorithm": name, "generator": device}, generate, name, device)
        for name in ("ar", "pearl")
        for device in dict.fromkeys(("cpu", plan.device.type))
    ]


def lossless(plan: Plan, cfg: GpuCheckConfig, models: Models) -> dict:
    rows = []
    for model, new_tokens in (("tiny", 32 if not plan.dry else 8), ("big", plan.new_tokens)):
        prompt = random_ids(32, models.get(model).config.vocab_size, cfg.seed)
        for dtype in plan.dtypes:
            rows += greedy_equality(plan, cfg, models, model, dtype, prompt, new_tokens)
    flips = [r for r in rows if r.get("equal") is False and not r.get("near_tie_flip")]
    return {
        "greedy": rows,
        "summary": {
            "comparisons": len(rows),
            "equal": sum(bool(r.get("equal")) for r in rows),
            "near_tie_flips": sum(bool(r.get("near_tie_flip")) for r in rows),
            "other_differences": len(flips),
        },
        "exact_law": exact_law(plan),
        "executors": executor_equality(plan, models),
        "generator_devices": generator_devices(plan, models),
    }


# -- section 2: AR speed -----------------------------------------------------------------------------------------


def copy_bandwidth(device: torch.device, size: int) -> float:
    """Bytes/s of a device-to-device copy of ``size`` bytes, counting bytes read and written (best of 10)."""
    src = torch.empty(size, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(timed(lambda: dst.copy_(src), device)[1] for _ in range(10))
    return 2 * size / best


def decode_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of weights one decode step reads: all but the embedding table, of which it reads one row."""
    embed = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()


def engine_ar(runner: ModelRunner, prompt: list[int], new_tokens: int, repeats: int = 3) -> tuple[float, list[int]]:
    """Best tokens/s of the engine's AR (prefill included, as GenerationStats.wall_s counts it) after a warm-up."""
    ar = build_algorithm("ar", runner)
    ar.generate(prompt, max_new_tokens=8, sampling=GREEDY)
    best, tokens = 0.0, []
    for _ in range(repeats):
        result = ar.generate(prompt, max_new_tokens=new_tokens, sampling=GREEDY)
        best, tokens = max(best, result.stats.tokens_per_s), result.tokens
    return best, tokens


def hf_generate(model: LlamaForCausalLM, prompt: list[int], new_tokens: int, repeats: int = 2, **options) -> dict:
    """transformers ``generate``, greedy, exactly ``new_tokens`` tokens: first-call seconds (with any compile),
    then the best tokens/s of ``repeats`` calls."""
    ids = torch.tensor([prompt], device=model.device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **options)
    with torch.no_grad():
        _, first_s = timed(lambda: model.generate(ids, **kwargs), model.device)
        best, out = 0.0, None
        for _ in range(repeats):
            out, seconds = timed(lambda: model.generate(ids, **kwargs), model.device)
            best = max(best, (out.shape[1] - len(prompt)) / seconds)
    return {"first_call_s": round(first_s, 2), "tokens_per_s": round(best, 1), "tokens": out[0, len(prompt) :].tolist()}


def ar_speed(plan: Plan, cfg: GpuCheckConfig, models: Models) -> dict:
    model = models.get("big", plan.dtypes[-1])
    prompt = random_ids(128, model.config.vocab_size, cfg.seed + 1)
    runner = runner_for(model, len(prompt) + plan.speed_tokens + 8)
    engine_tps, engine_tokens = engine_ar(runner, prompt, plan.speed_tokens)
    bandwidth = copy_bandwidth(plan.device, (1 << 30) if not plan.dry else (1 << 26))
    step_bytes = decode_bytes(model)
    roofline = bandwidth / step_bytes
    result: dict[str, Any] = {
        "dtype": plan.dtypes[-1],
        "new_tokens": plan.speed_tokens,
        "prompt_tokens": len(prompt),
        "engine_tokens_per_s": round(engine_tps, 1),
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "decode_weight_gb": round(step_bytes / 1e9, 3),
        "roofline_tokens_per_s": round(roofline, 1),
        "engine_pct_of_roofline": round(100 * engine_tps / roofline, 1),
    }
    variants = {
        "dynamic cache": {},
        "static cache, eager": {"cache_implementation": "static", "disable_compile": True},
        "static cache, auto-compiled": {"cache_implementation": "static"},
    }
    if plan.dry:  # transformers compiles only on accelerators; on the CPU it would be the eager run again
        variants.pop("static cache, auto-compiled")

    def compare(options: dict) -> dict:
        out = hf_generate(model, prompt, plan.speed_tokens, **options)
        return {
            "first_call_s": out["first_call_s"],
            "tokens_per_s": out["tokens_per_s"],
            "engine_ratio": round(engine_tps / out["tokens_per_s"], 2),
            "same_tokens_as_engine": out["tokens"] == engine_tokens,
            "first_divergence": first_divergence(out["tokens"], engine_tokens),
        }

    result["generate"] = [attempt({"variant": name}, compare, options) for name, options in variants.items()]
    return result


def ar_compiled(plan: Plan, cfg: GpuCheckConfig, models: Models) -> dict:
    """The engine's AR with ``ModelRunner._layers`` compiled on this runner instance only (nothing else changes)."""
    if plan.dry:
        return {"skipped": "cpu_dry_run: inductor on a CPU takes minutes and measures nothing about CUDA"}
    model = models.get("big", plan.dtypes[-1])
    prompt = random_ids(128, model.config.vocab_size, cfg.seed + 1)
    eager = runner_for(model, len(prompt) + plan.speed_tokens + 8)
    eager_tps, eager_tokens = engine_ar(eager, prompt, plan.speed_tokens)
    compiled = runner_for(model, len(prompt) + plan.speed_tokens + 8)
    # dynamic=True: the cached length (an int argument and the attended slice) changes every step
    compiled._layers = torch.compile(compiled._layers, dynamic=True)
    ar = build_algorithm("ar", compiled)
    _, compile_s = timed(lambda: ar.generate(prompt, max_new_tokens=plan.speed_tokens, sampling=GREEDY), plan.device)
    tps, tokens = engine_ar(compiled, prompt, plan.speed_tokens)
    return {
        "compile_and_first_run_s": round(compile_s, 1),
        "eager_tokens_per_s": round(eager_tps, 1),
        "compiled_tokens_per_s": round(tps, 1),
        "speedup": round(tps / eager_tps, 2),
        "same_tokens_as_eager": tokens == eager_tokens,
        "first_divergence": first_divergence(tokens, eager_tokens),
    }


# -- section 3: verification cost --------------------------------------------------------------------------------


def forward_ms(runner: ModelRunner, ids: torch.Tensor, repeats: int, **forward) -> float:
    """Median milliseconds of one forward over the current cache (truncated back after each), after a warm-up."""
    start_len = runner.length()
    times = []
    for _ in range(repeats + 1):  # the first call pays for allocation and kernel selection
        times.append(timed(lambda: runner.forward(ids, **forward), runner.device)[1])
        runner.truncate(start_len)
    return statistics.median(times[1:]) * 1000


def verify_cost(plan: Plan, cfg: GpuCheckConfig, models: Models) -> dict:
    model = models.get("big", plan.dtypes[-1])
    vocab = model.config.vocab_size
    runner = runner_for(model, max(plan.contexts) + max(plan.verify_tokens) + 8)
    new = torch.tensor([random_ids(max(plan.verify_tokens), vocab, cfg.seed + 2)], device=plan.device)
    rows = []
    for context in plan.contexts:
        runner.reset(1)
        runner.forward(
            torch.tensor([random_ids(context, vocab, cfg.seed + 3)], device=plan.device), only_last_logits=True
        )
        decode = forward_ms(runner, new[:, :1], plan.repeats)
        for tokens in plan.verify_tokens:
            mask, depth = tree_mask(random_tree(tokens, tokens))
            chain = forward_ms(runner, new[:, :tokens], plan.repeats)
            tree = forward_ms(
                runner, new[:, :tokens], plan.repeats, attention_mask=mask, positions=torch.tensor([depth]) + context
            )
            rows.append(
                {
                    "context": context,
                    "tokens": tokens,
                    "decode_ms": round(decode, 3),
                    "chain_ms": round(chain, 3),
                    "chain_x_decode": round(chain / decode, 2),
                    "tree_ms": round(tree, 3),
                    "tree_x_decode": round(tree / decode, 2),
                    "tree_depth": max(depth) + 1,
                }
            )
    return {"dtype": plan.dtypes[-1], "repeats": plan.repeats, "forwards": rows}


# -- section 4: training ------------------------------------------------------------------------------------------


def recipe_config(name: str, plan: Plan, target: LlamaForCausalLM, schema: type):
    """The recipe's config as ``spectrain.fit`` composes it (schema + recipe file + the kind's model defaults),
    without Hydra (not on the device): the in-memory target, and toy sizes on the CPU dry run."""
    recipe = OmegaConf.load(REPO / "recipes" / "recipe" / f"{name}.yaml")
    recipe.target = "random-1b-in-memory"  # replaces the recipe's ${oc.env:SPECTRAIN_LLAMA8B,...}
    recipe.model.draft_vocab_size = min(recipe.model.draft_vocab_size, target.config.vocab_size)
    if plan.dry:  # toy sizes, fp32 (the CPU bf16 paths are not what this dry run checks)
        recipe.data.max_len, recipe.data.batch_size, recipe.trainer.precision = plan.train_len, 2, "32-true"
    cfg = OmegaConf.merge(OmegaConf.structured(FitConfig), recipe)
    cfg.model = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(schema), cfg.model))
    return cfg


def feature_batch(
    target: LlamaForCausalLM, layers: list[int], batch_size: int, max_len: int, seed: int
) -> dict[str, torch.Tensor]:
    """A training batch as the online DataModule makes it (data_prep.capture + collate_features): random token
    sequences of ``max_len`` tokens, the last three quarters supervised, the target's real features."""
    samples = [
        TokenSample(
            i,
            random_ids(max_len, target.config.vocab_size, seed + i),
            [0] * (max_len // 4) + [1] * (max_len - max_len // 4),
        )
        for i in range(batch_size)
    ]
    runner = runner_for(target, max_len, max_batch_size=batch_size)
    rows = HiddenCapture(runner, layers, dtype="bf16")(samples)
    return {k: v.to(target.device) for k, v in collate_features(rows).items()}


def with_target(module_class: type, target: LlamaForCausalLM) -> type:
    """``module_class`` whose ``target_model()`` is ``target`` (built here) instead of one loaded from a path."""
    return type(module_class.__name__, (module_class,), {"target_model": lambda self: target})


def train_step(
    plan: Plan, recipe: str, target: LlamaForCausalLM, module_class: type, schema: type, steps: int = 3
) -> dict:
    """Seconds per training step (forward, backward, AdamW; the batch is made beforehand) and peak memory."""
    cfg = recipe_config(recipe, plan, target, schema)
    before = torch.cuda.memory_allocated(plan.device) if plan.device.type == "cuda" else 0  # the target and the rest
    module = with_target(module_class, target)(cfg).to(plan.device)
    module.log = lambda *a, **k: None  # no Trainer attached: logging is a no-op here
    layers = resolve_layers(cfg.data.layers, target.config.num_hidden_layers)
    batch = feature_batch(target, layers, cfg.data.batch_size, cfg.data.max_len, seed=5)
    optimizer = module.configure_optimizers()["optimizer"]
    autocast = cfg.trainer.precision == "bf16-mixed"

    def one_step() -> float:
        with torch.autocast(plan.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = module.training_step(batch, 0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    module.train()
    one_step()  # warm-up: allocations, kernel selection, AdamW's states
    if plan.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(plan.device)
    losses, seconds = [], []
    for _ in range(steps):
        loss, s = timed(one_step, plan.device)
        losses.append(round(loss, 4))
        seconds.append(s)
    trainable, frozen = parameter_counts(module.drafter)
    target_params = sum(p.numel() for p in target.parameters())
    peak = None
    if plan.device.type == "cuda":  # what training adds to the memory in use before it, plus the target's weights
        added = torch.cuda.max_memory_allocated(plan.device) - before
        peak = (added + target_params * target.dtype.itemsize) / 2**30
    est = estimate(trainable, frozen, target_params, strategy="auto", devices=1, precision=cfg.trainer.precision)
    return {
        "precision": cfg.trainer.precision,
        "batch_size": cfg.data.batch_size,
        "max_len": cfg.data.max_len,
        "drafter_params_m": round(trainable / 1e6, 1),
        "step_s": round(statistics.median(seconds), 3),
        "losses": losses,
        "peak_gib": None if peak is None else round(peak, 2),
        "estimated_gib": round(est.total_gib, 2),
        "estimate": est.line("one device, no sharding"),
    }


def background_adapter(plan: Plan, models: Models) -> dict:
    """The serving-time adapter with ``background=True`` on the tiny target: its updates run on a worker thread
    (on a side CUDA stream) while the next query is served; every served answer must stay AR's."""
    if "bandit" not in observer_names():  # the device's tree is not pip-installed: no entry point there
        register_observer("bandit", BANDIT)
    target = models.get("tiny")
    settings = AdaptSettings(
        prior=5.0,
        min_gap=1,
        cost_cache=None,
        cost_rows=24,
        head_lr=1e-2,
        full_lr=1e-2,
        validate=False,
        log=None,
        background=True,
    )  # every allowed query updates
    drafter = random_eagle3(target, draft_vocab=60)
    loaded = {k: v.clone() for k, v in drafter.state_dict().items()}
    ar = build_algorithm("ar", runner_for(target, 128))
    algorithm = build_algorithm(
        "eagle3_tree",
        runner_for(target, 128),
        drafter,
        tree_depth=3,
        tree_topk=3,
        tree_total=10,
        adapt="bandit",
        adapt_settings=settings,
    )
    prompts = [random_ids(6, target.config.vocab_size, 40 + i) for i in range(5)]
    equal = []
    for prompt in prompts:
        served = algorithm.generate(prompt, max_new_tokens=20, sampling=GREEDY).tokens
        equal.append(served == ar.generate(prompt, max_new_tokens=20, sampling=GREEDY).tokens)
    adapter = algorithm.adapter
    side_stream = getattr(getattr(adapter, "background", None), "stream", None)
    adapter.close()
    serving = algorithm.drafter.state_dict()
    changed = any(
        not torch.equal(loaded[k], serving[k.replace(".base_layer.", ".")])
        for k in loaded
        if k.replace(".base_layer.", ".") in serving
    )
    return {
        "queries": len(prompts),
        "all_equal_to_ar": all(equal),
        "equal_per_query": equal,
        "arms": [row["arm"] for row in adapter.log.rows],
        "serving_weights_changed": changed,
        "side_stream": side_stream is not None,
    }


def training(plan: Plan, cfg: GpuCheckConfig, models: Models) -> dict:
    dtype = "fp32" if plan.dry else "bf16"  # fit's online target: bf16 on CUDA
    target = models.get("big", dtype)
    models.keep_only(("big", dtype), ("tiny", "fp32"))
    rows = []
    for recipe, module_class, schema in (
        ("eagle3_llama8b", Eagle3Module, Eagle3Schema),
        ("specblock_llama8b", SpecBlockModule, SpecBlockSchema),
    ):
        rows.append(attempt({"recipe": recipe}, train_step, plan, recipe, target, module_class, schema))
        free_memory(plan.device)
    return {"steps": rows, "background_adapter": attempt({}, background_adapter, plan, models)}


# -- running and reporting ---------------------------------------------------------------------------------------


def attempt(row: dict, fn: Callable[..., dict], *args: Any) -> dict:
    """``row`` updated with ``fn(*args)``'s fields, or with its error: a failing case is a result, the rest still
    run."""
    try:
        row.update(fn(*args))
    except Exception as exc:  # noqa: BLE001 - recorded, not raised
        row.update(error=short_error(exc), traceback=traceback_tail(exc, 3))
    return row


def short_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"


def traceback_tail(exc: BaseException, frames: int = 6) -> list[str]:
    """The last ``frames`` frames as 'file:line in function: code' (enough to find the failing call)."""
    summary = traceback.extract_tb(exc.__traceback__)[-frames:]
    return [f"{Path(f.filename).name}:{f.lineno} in {f.name}: {f.line}" for f in summary]


def git_commit(given: str) -> str:
    if given:
        return given
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(plan: Plan, cfg: GpuCheckConfig, argv: Sequence[str]) -> dict:
    device = torch.cuda.get_device_name() if plan.device.type == "cuda" else f"CPU ({platform.processor() or '?'})"
    return {
        "device": device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "tf32_matmul": bool(getattr(torch.backends.cuda.matmul, "allow_tf32", False)),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(cfg.commit),
        "command": "python -m benchmarks.gpu_check " + " ".join(argv),
        "cpu_dry_run": plan.dry,
    }


@contextmanager
def section_record(results: dict, name: str, out: Path) -> Iterator[dict]:
    """Record one section: its data, or its error and traceback; its seconds. results.json and report.md are
    rewritten after each section, so a run cut short leaves what it measured."""
    record: dict[str, Any] = {"ok": False}
    results["sections"][name] = record
    start = time.perf_counter()
    try:
        yield record
        record["ok"] = True
    except Exception as exc:  # noqa: BLE001 - a failed section is recorded, the next one still runs
        record.update(error=short_error(exc), traceback=traceback_tail(exc))
    finally:
        record["seconds"] = round(time.perf_counter() - start, 1)
        write_json(out / "results.json", results)
        write_report(out / "report.md", results)


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def md_table(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for row in rows for k in row))
    cell = lambda v: "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join(lines + ["| " + " | ".join(cell(row.get(k)) for k in keys) + " |" for row in rows])


def md_section(name: str, record: dict) -> list[str]:
    """A section's scalars as a list and each list of rows (or nested dict) as a table."""
    lines = [f"## {name}", "", f"- ok: {record['ok']}, {record['seconds']} s"]
    tables = []
    for key, value in record.items():
        if key in ("ok", "seconds"):
            continue
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            tables += ["", f"### {key}", "", md_table(value)]
        elif isinstance(value, dict):
            tables += ["", f"### {key}", "", md_table([value])]
        else:
            lines.append(f"- {key}: {value}")
    return lines + tables + [""]


def write_report(path: Path, results: dict) -> None:
    env = results["environment"]
    lines = ["# spectrain GPU check (issue #36)", "", *[f"- {k}: `{v}`" for k, v in env.items()], ""]
    for name, record in results["sections"].items():
        lines += md_section(name, record)
    path.write_text("\n".join(lines))


SECTION_FUNCTIONS: dict[str, Callable[[Plan, GpuCheckConfig, Models], dict]] = {
    "lossless": lossless,
    "ar_speed": ar_speed,
    "verify_cost": verify_cost,
    "training": training,
    "ar_compiled": ar_compiled,
}


def run(cfg: GpuCheckConfig, argv: Sequence[str]) -> str:
    unknown = sorted(set(cfg.sections) - set(SECTIONS))
    if unknown:
        raise UserError(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    plan = Plan.of(cfg)
    out = run_dir(cfg, "gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"environment": environment(plan, cfg, argv), "sections": {}}
    models = Models(plan)
    threads = torch.get_num_threads()
    apply_threads(cfg)
    if plan.dry:  # the toy models' matmuls are too small for threads, which only spin against other work here
        torch.set_num_threads(1)
    try:
        for name in [s for s in SECTIONS if s in cfg.sections]:
            # inference sections under no_grad; training needs autograd
            with section_record(results, name, out) as record, nullcontext() if name == "training" else torch.no_grad():
                record.update(SECTION_FUNCTIONS[name](plan, cfg, models))
            free_memory(plan.device)
            print(
                f"[gpu_check] {name}: {'ok' if record['ok'] else record['error']} ({record['seconds']} s)", flush=True
            )
    finally:
        torch.set_num_threads(threads)
    return f"wrote {out / 'results.json'} and {out / 'report.md'}"


def parse_args(argv: Sequence[str]) -> Any:
    return parse_bench(argv, GpuCheckConfig, USAGE)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_cli(
        argv,
        lambda args: run(parse_args(args), args),
        doc=__doc__,
        schema=GpuCheckConfig,
        report=print,
    )


if __name__ == "__main__":
    sys.exit(main())
