"""A tiny target with a close draft, its AR tokens, and the check that an executor matches sequential."""

from __future__ import annotations

import copy
import functools

import torch
from tiny_targets import GREEDY, runner, tiny_llama

from inference.algorithms import build_algorithm
from inference.draft_side import DraftSide, draft_side_from_runner
from inference.sampling import SamplingParams

PROMPT = [7, 1, 8, 2, 8]


def noisy_copy(model, noise: float, seed: int = 5):
    """The model with every weight perturbed: a draft that agrees with it often, not always."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(noise * torch.randn(param.shape, generator=generator))
    return draft


def tiny_pair(noise: float = 0.002, scale: float = 8.0):
    target = tiny_llama(0, layers=2, temperature_scale=scale)
    return target, noisy_copy(target, noise)


def tiny_draft_side(kmax: int = 1, noise: float = 0.002, scale: float = 8.0) -> DraftSide:
    """Picklable draft-side builder (what a multiprocess draft process runs): rebuilds the same tiny draft."""
    return draft_side_from_runner(runner(tiny_pair(noise, scale)[1]), kmax)


def ar_tokens(target, n: int) -> list[int]:
    return build_algorithm("ar", runner(target)).generate(PROMPT, max_new_tokens=n, sampling=GREEDY).tokens


def assert_executor_matches_sequential(target, name: str, build, kmax: int) -> None:
    """``build(executor, **kwargs)`` under executor ``name`` gives the sequential executor's tokens: one greedy
    answer (= AR's) and two T=1 answers from one seeded generator (they differ from each other)."""

    def run(executor: str, **kwargs) -> list[list[int]]:
        algorithm = build(executor, **kwargs)
        try:
            outputs = [algorithm.generate(PROMPT, max_new_tokens=24, sampling=GREEDY).tokens]
            generator = torch.Generator().manual_seed(3)
            for _ in range(2):
                outputs.append(
                    algorithm.generate(
                        PROMPT, max_new_tokens=16, sampling=SamplingParams(1.0), generator=generator
                    ).tokens
                )
            return outputs
        finally:
            algorithm.close()

    kwargs = {}
    if name == "multiprocess":
        kwargs = {"draft_factory": functools.partial(tiny_draft_side, kmax), "executor_kwargs": {"threads": 1}}
    reference = run("sequential")
    assert reference[0] == ar_tokens(target, 24) and reference[1] != reference[2]
    assert run(name, **kwargs) == reference
