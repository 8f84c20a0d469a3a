"""``python -m inference.generate target=smollm2 algorithm=ar prompt="..."`` — stream one answer.

The prompt is a single user message rendered with the target's chat template. An algorithm with a drafter takes
``drafter=PATH`` (a draft LM, or an export of the kind the algorithm needs) or ``drafters=DIR`` (a directory of
exports), as ``inference.evaluate`` does; an option the algorithm does not read is refused. Statistics (tokens/s,
τ) are printed to stderr after the answer.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from core.drafters.kinds import engine_kind
from core.overrides import OverrideError, run_cli
from core.prompts import render_prompt
from inference.algorithms import ALGORITHMS, algorithm_class
from inference.algorithms.base import GenerationResult
from inference.algorithms.options import apply_threads
from inference.drafters import LoadedModel, eos_token_ids
from inference.engine_args import (
    EngineArgs,
    build_algorithms,
    check_algorithm_options,
    check_placement,
    load_target,
    parse_engine_cli,
    sampling_params,
)

USAGE = 'python -m inference.generate target=smollm2 algorithm=ar prompt="..." [drafter=PATH] [max_new_tokens=N]'


@dataclass
class GenerateConfig(EngineArgs):
    prompt: str = ""
    algorithm: str = "ar"
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
        stream.write(text[len(self.printed) :])
        stream.flush()
        self.printed = text


def generate_text(
    cfg: Any, target: LoadedModel | None = None, draft: LoadedModel | Any = None, on_tokens=None
) -> GenerationResult:
    """Answer ``cfg.prompt`` with ``cfg.algorithm``, loading what is not given: the target, and the drafter (a
    LoadedModel draft LM, or a drafter module for feature algorithms)."""
    kind = algorithm_class(cfg.algorithm).drafter
    preloaded = {kind: draft.runner if isinstance(draft, LoadedModel) else draft}
    target, built = build_algorithms(cfg, [cfg.algorithm], target, preloaded)
    algorithm, _ = built[cfg.algorithm]
    prompt_ids = render_prompt(target.tokenizer, [{"role": "user", "content": cfg.prompt}])
    try:
        return algorithm.generate(
            prompt_ids,
            max_new_tokens=cfg.max_new_tokens,
            sampling=sampling_params(cfg),
            generator=torch.Generator().manual_seed(cfg.seed),
            eos_ids=eos_token_ids(target.tokenizer, target.model.config),
            on_tokens=on_tokens,
        )
    finally:
        getattr(algorithm, "close", lambda: None)()  # a draft process or thread


def _run(args: list[str]) -> tuple[Any, GenerationResult]:
    cfg, given = parse_engine_cli(args, GenerateConfig, USAGE)
    if not cfg.prompt:
        raise OverrideError(f"no prompt given; usage: {USAGE}")
    if cfg.max_new_tokens < 1:
        raise OverrideError(f"max_new_tokens={cfg.max_new_tokens} must be >= 1")
    if "@" in cfg.algorithm:
        raise OverrideError(
            f"algorithm={cfg.algorithm}: generate runs one algorithm; set its options as "
            "NAME.key=value (variants NAME@key=value are for inference.evaluate and inference.serve)"
        )
    check_algorithm_options(cfg, given, [cfg.algorithm])
    check_placement(cfg)
    try:
        sampling_params(cfg)
    except ValueError as exc:
        raise OverrideError(str(exc)) from None
    kind = algorithm_class(cfg.algorithm).drafter
    if kind != "none" and not (cfg.drafter or cfg.drafters or cfg.drafter_by_kind):
        raise OverrideError(f"algorithm '{cfg.algorithm}' needs {engine_kind(kind).needs}: add drafter=PATH")
    apply_threads(cfg)
    target = load_target(cfg)
    return cfg, generate_text(cfg, target, on_tokens=TextStreamer(target.tokenizer))


def _report(outcome: tuple[Any, GenerationResult]) -> None:
    cfg, result = outcome
    stats = result.stats
    print(
        f"\n[{cfg.algorithm}] {stats.new_tokens} tokens in {stats.wall_s:.2f} s = {stats.tokens_per_s:.1f} tokens/s, "
        f"τ = {stats.tau:.2f} tokens per target forward",
        file=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    doc = f"{__doc__}\nalgorithms: {', '.join(ALGORITHMS)}"
    return run_cli(argv, _run, doc=doc, schema=GenerateConfig, report=_report)


if __name__ == "__main__":
    sys.exit(main())
