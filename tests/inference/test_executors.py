"""Executors: every backend runs the same draft-side calls in the same order, so outputs are identical."""

from __future__ import annotations

import functools

import pytest
import torch

from inference.executors import EXECUTORS, OverlapStats, make_executor


class SampledDraftSide:
    """A stateful draft side with its own seeded generator, like a drafter's KV cache + sampler."""

    def __init__(self, seed: int, vocab: int = 11):
        self.generator = torch.Generator().manual_seed(seed)
        self.weights = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(123))
        self.history: list[int] = []

    def draft(self, last_token: int, n: int) -> tuple[list[int], torch.Tensor]:
        tokens, probs = [], []
        for _ in range(n):
            p = torch.softmax(self.weights[last_token], -1)
            last_token = int(torch.multinomial(p, 1, generator=self.generator))
            tokens.append(last_token)
            probs.append(p)
        self.history.extend(tokens)
        return tokens, torch.stack(probs)

    def fail(self) -> None:
        raise ValueError("bad draft request")


def run_rounds(executor, rounds: int = 5) -> list:
    outputs = [executor.call("draft", 0, 2)]
    target_gen = torch.Generator().manual_seed(7)
    last = outputs[0][0][-1]
    for _ in range(rounds):
        target, (tokens, probs) = executor.overlap(
            lambda: int(torch.randint(11, (1,), generator=target_gen)), "draft", last, 3
        )
        outputs.append((target, tokens, probs))
        last = (tokens[-1] + target) % 11
    return outputs


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("name", ["cuda_streams", "multiprocess"])
def test_every_backend_gives_the_sequential_results(name):
    factory = functools.partial(SampledDraftSide, 3)
    with make_executor("sequential", factory) as executor:
        reference = run_rounds(executor)
        stats = executor.stats
    with make_executor(name, factory, **({"threads": 1} if name == "multiprocess" else {})) as executor:
        assert same(run_rounds(executor), reference)
        assert executor.stats.rounds == 5
    assert stats.rounds == 5 and stats.draft_s > 0 and stats.target_s > 0


def test_simulated_latency_is_the_sum_of_per_round_maxima():
    executor = make_executor("sequential", functools.partial(SampledDraftSide, 0))
    run_rounds(executor, rounds=3)
    s: OverlapStats = executor.stats
    assert max(s.target_s, s.draft_s) <= s.simulated_s <= s.target_s + s.draft_s + 1e-9
    assert s.wall_s >= s.simulated_s * 0.5


@pytest.mark.parametrize("name", EXECUTORS)
def test_draft_side_errors_reach_the_caller(name):
    kwargs = {"threads": 1} if name == "multiprocess" else {}
    with make_executor(name, functools.partial(SampledDraftSide, 0), **kwargs) as executor:
        with pytest.raises((ValueError, RuntimeError), match="bad draft request"):
            executor.call("fail")
        assert executor.call("draft", 1, 1)[0]  # still serving after an error


def test_unknown_executor_is_refused():
    with pytest.raises(ValueError, match="choose one of sequential, cuda_streams, multiprocess"):
        make_executor("threads", functools.partial(SampledDraftSide, 0))
