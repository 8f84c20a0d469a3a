"""``python -m benchmarks.draft_agreement drafter=DIR [bench=gsm_symbolic] [n_prompts=6] [max_new_tokens=128]
[draft_vocab=8192] [dtype=auto] [out=FILE.json]``

How often a draft LM's guesses are the target's token, on held-out prompts: the target answers each prompt
greedily (AR), then the draft reads prompt + answer in one teacher-forced forward, and at every answer position
we count whether the target's token is the draft's top-1 (top-1 agreement) or among its top k (top-k recall:
what SSD's cache needs for a hit after a rejected first draft, and SpecBranch's branches).

This differs from the acceptance of a speculative round's first draft token (``acceptance_by_position[0]`` of an
evaluate run): rounds start right after a rejection, where the text is harder than average, so that figure is
lower than the agreement over all positions, for the same draft.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.config import Bench, BenchConfig, DraftLM, Dtype, Output, SeqLen, Target, Workload, parse_bench
from core.atomic import atomic_write_text
from core.overrides import OverrideError, run_cli
from inference.algorithms import build_algorithm
from inference.algorithms.options import apply_threads
from inference.drafters import eos_token_ids, load_drafter, load_lm, model_dtype, serving_dtype
from inference.evaluate import load_bench_prompts
from inference.runner_loading import with_logit_vocab
from inference.sampling import SamplingParams

USAGE = (
    "python -m benchmarks.draft_agreement drafter=DIR bench=gsm_symbolic n_prompts=6 max_new_tokens=128 "
    "draft_vocab=8192 dtype=auto out=FILE.json"
)
TOP_K = (1, 2, 4, 8)


@dataclass
class AgreementConfig(BenchConfig, Output, Target, Dtype, SeqLen, DraftLM, Bench, Workload):
    """``out``: FILE.json (optional)."""


def agreement(cfg: Any) -> dict:
    if not cfg.drafter:
        raise OverrideError(f"drafter=DIR (a draft LM) is required; usage: {USAGE}")
    apply_threads(cfg)
    dtype = serving_dtype(cfg.dtype)
    target = load_lm(cfg.target, device="cpu", max_seq_len=cfg.max_seq_len, dtype=model_dtype(dtype, "cpu"))
    draft = with_logit_vocab(
        load_drafter("draft_lm", cfg.drafter, target, device="cpu", max_seq_len=cfg.max_seq_len), cfg.draft_vocab
    )
    prompts = load_bench_prompts(cfg.bench, target.tokenizer, cfg.n_prompts)
    eos = eos_token_ids(target.tokenizer, target.model.config)
    ar = build_algorithm("ar", target.runner)
    hits = {k: 0 for k in TOP_K}
    positions = 0
    for ids in prompts.ids:
        answer = ar.generate(ids, max_new_tokens=cfg.max_new_tokens, sampling=SamplingParams(0.0), eos_ids=eos).tokens
        draft.reset(1)
        # Row i of the answer part predicts answer[i]: the rows from the prompt's last token on.
        logits = draft.forward(torch.tensor([ids + answer[:-1]])).logits[0, len(ids) - 1 :]
        ranked = logits.topk(max(TOP_K), dim=-1).indices
        truth = torch.tensor(answer)[:, None]
        for k in TOP_K:
            hits[k] += int((ranked[:, :k] == truth).any(-1).sum())
        positions += len(answer)
    result = {
        "bench": cfg.bench,
        "n_prompts": len(prompts.ids),
        "positions": positions,
        "dtype": dtype,
        "draft_vocab": cfg.draft_vocab,
        "drafter": cfg.drafter,
        "top1_agreement": hits[1] / positions,
        "top_k_recall": {str(k): hits[k] / positions for k in TOP_K},
    }
    if cfg.out:
        atomic_write_text(Path(cfg.out), json.dumps(result, indent=2) + "\n")
    return result


def report(result: dict) -> None:
    recall = ", ".join(f"top-{k} {v:.3f}" for k, v in result["top_k_recall"].items())
    print(
        f"{result['bench']}: {result['positions']} answer tokens of {result['n_prompts']} prompts ({result['dtype']}, "
        f"draft_vocab={result['draft_vocab']}): top-1 agreement {result['top1_agreement']:.3f}; recall {recall}"
    )


def parse_args(argv: Sequence[str]) -> Any:
    return parse_bench(argv, AgreementConfig, USAGE)


def main(argv: list[str] | None = None) -> int:
    return run_cli(
        argv,
        lambda args: agreement(parse_args(args)),
        doc=__doc__,
        schema=AgreementConfig,
        report=report,
    )


if __name__ == "__main__":
    sys.exit(main())
