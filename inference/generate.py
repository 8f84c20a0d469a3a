"""``python -m inference.generate target=smollm2 algorithm=ar prompt="..."`` — stream one answer.

The prompt is a single user message rendered with the target's chat template. Draft-LM algorithms take
``drafter=PATH`` (a draft LM); ``eagle3_tree`` and ``specblock_tree`` take ``drafter=PATH`` (their export).
Statistics (tokens/s,
τ) are printed to stderr after the answer.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from core.overrides import OverrideError, parse_cli, run_cli
from core.prompts import render_prompt
from inference.algorithms import ALGORITHMS, algorithm_class, build_algorithm
from inference.algorithms.base import GenerationResult
from inference.algorithms.options import AlgorithmOptions, apply_threads
from inference.drafters import (DRAFTER_KINDS, LoadedModel, eos_token_ids, load_drafter, load_lm, model_dtype,
                                pick_device)
from inference.runner_loading import with_logit_vocab
from inference.sampling import SamplingParams

USAGE = 'python -m inference.generate target=smollm2 algorithm=ar prompt="..." [drafter=PATH] [max_new_tokens=N]'


@dataclass
class GenerateConfig(AlgorithmOptions):
    prompt: str = ""
    target: str = "smollm2"
    algorithm: str = "ar"
    drafter: str | None = None
    max_new_tokens: int = 256


class TextStreamer:
    """Decodes the growing answer and prints only the new text, so multi-token characters come out whole."""

    def __init__(self, tokenizer, stream=None):
        self.tokenizer, self.stream = tokenizer, stream
        self.tokens: list[int] = []
        self.printed = ""

    def __call__(self, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return
        stream = self.stream or sys.stdout  # looked up per call, so redirections made later still apply
        stream.write(text[len(self.printed):])
        stream.flush()
        self.printed = text


def generate_text(cfg: Any, target: LoadedModel, draft: LoadedModel | None = None,
                  on_tokens=None) -> GenerationResult:
    """Answer ``cfg.prompt`` with ``cfg.algorithm`` on an already loaded target (and draft: a LoadedModel draft
    LM, or an EAGLE-3 drafter module for feature algorithms)."""
    cls = algorithm_class(cfg.algorithm)
    drafter = draft.runner if isinstance(draft, LoadedModel) else draft
    if cls.drafter == "draft_lm" and drafter is not None:
        drafter = with_logit_vocab(drafter, cfg.draft_vocab)
    algorithm = build_algorithm(cfg.algorithm, target.runner, drafter, **cls.options_from_config(cfg))
    prompt_ids = render_prompt(target.tokenizer, [{"role": "user", "content": cfg.prompt}])
    return algorithm.generate(prompt_ids, max_new_tokens=cfg.max_new_tokens,
                              sampling=SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p),
                              generator=torch.Generator().manual_seed(cfg.seed),
                              eos_ids=eos_token_ids(target.tokenizer, target.model.config), on_tokens=on_tokens)


def _run(args: list[str]) -> tuple[Any, GenerationResult]:
    cfg = parse_cli(args, GenerateConfig, USAGE)
    if not cfg.prompt:
        raise OverrideError(f"no prompt given; usage: {USAGE}")
    apply_threads(cfg)
    cls = algorithm_class(cfg.algorithm)
    if cls.drafter != "none" and not cfg.drafter:
        raise OverrideError(f"algorithm '{cfg.algorithm}' needs {DRAFTER_KINDS[cls.drafter][1]}: add drafter=PATH")
    try:
        dtype = model_dtype(cfg.dtype, pick_device(cfg.device))
    except ValueError as exc:
        raise OverrideError(str(exc)) from None
    target = load_lm(cfg.target, device=cfg.device, max_seq_len=cfg.max_seq_len, dtype=dtype,
                     chat_template=cfg.chat_template)
    draft = None
    if cls.drafter != "none":
        draft = load_drafter(cls.drafter, cfg.drafter, target, device=cfg.device, max_seq_len=cfg.max_seq_len)
    return cfg, generate_text(cfg, target, draft, on_tokens=TextStreamer(target.tokenizer))


def _report(outcome: tuple[Any, GenerationResult]) -> None:
    cfg, result = outcome
    stats = result.stats
    print(f"\n[{cfg.algorithm}] {stats.new_tokens} tokens in {stats.wall_s:.2f} s = {stats.tokens_per_s:.1f} tokens/s, "
          f"τ = {stats.tau:.2f} tokens per target forward", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    doc = f"{__doc__}\nalgorithms: {', '.join(ALGORITHMS)}"
    return run_cli(argv, _run, doc=doc, schema=GenerateConfig, report=_report)


if __name__ == "__main__":
    sys.exit(main())
