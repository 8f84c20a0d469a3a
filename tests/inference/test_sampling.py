"""Warping (temperature, top-k, top-p) and sampling with an injected generator."""

from __future__ import annotations

import math

import pytest
import torch

from inference.sampling import SamplingParams, sample, warp_probs

F64 = torch.float64


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-12) -> None:
    # Plain max-abs check: torch.testing.assert_close costs ~1 s of lazy imports on first use.
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert (actual - expected).abs().max().item() <= atol, (actual, expected)


def test_temperature_zero_is_one_hot_argmax_with_lowest_id_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.5, 0.1, 0.5, 0.5]], dtype=F64)
    probs = warp_probs(logits, temperature=0.0, top_k=2, top_p=0.5)  # filters are irrelevant at T=0
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    assert probs.dtype == F64


def test_temperature_scales_logits() -> None:
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0), dtype=F64)
    assert_close(warp_probs(logits, 1.0), logits.softmax(-1))
    assert_close(warp_probs(logits, 2.0), (logits / 2).softmax(-1))


def test_top_k_keeps_k_best_and_renormalises() -> None:
    logits = torch.tensor([0.0, 2.0, 1.0, 3.0, -1.0], dtype=F64)
    probs = warp_probs(logits, 1.0, top_k=2)
    expected = torch.zeros(5, dtype=F64)
    expected[[1, 3]] = torch.tensor([2.0, 3.0], dtype=F64).softmax(-1)
    assert_close(probs, expected)
    assert_close(warp_probs(logits, 1.0, top_k=5), logits.softmax(-1))  # k >= V: no-op


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    base = torch.tensor([0.1, 0.5, 0.05, 0.35], dtype=F64)
    logits = base.log()
    for top_p, support in [(0.4, [1]), (0.7, [1, 3]), (0.9, [0, 1, 3]), (1.0, [0, 1, 2, 3])]:
        probs = warp_probs(logits, 1.0, top_p=top_p)
        assert (probs > 0).nonzero().flatten().tolist() == support, top_p
        assert_close(probs[support], base[support] / base[support].sum())
        assert probs.sum().item() == pytest.approx(1.0, abs=1e-15)


def test_top_k_then_top_p_on_batches() -> None:
    base = torch.tensor([[0.1, 0.5, 0.05, 0.35], [0.25, 0.25, 0.3, 0.2]], dtype=F64)
    probs = warp_probs(base.log(), 1.0, top_k=3, top_p=0.6)
    # Row 0: top-3 = {1, 3, 0}, renormalised 0.5/0.95 < 0.6 so token 3 joins. Row 1: top-3 = {2, 0, 1}.
    assert (probs > 0).tolist() == [[False, True, False, True], [True, False, True, False]]


def test_masked_logits_get_zero_probability() -> None:
    logits = torch.tensor([0.0, float("-inf"), 1.0])
    assert warp_probs(logits, 0.7)[1].item() == 0.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
    ],
)
def test_invalid_params_raise(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
    args = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, **kwargs}
    with pytest.raises(ValueError, match=message):
        warp_probs(torch.zeros(3), **args)


def test_sampling_params() -> None:
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams().greedy
    logits = torch.tensor([0.3, 1.2, -0.4], dtype=F64)
    params = SamplingParams(temperature=0.8, top_k=2, top_p=0.9)
    assert_close(params.warp(logits), warp_probs(logits, 0.8, 2, 0.9))


def test_sample_greedy_uses_argmax_without_randomness() -> None:
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    probs = warp_probs(torch.tensor([[0.1, 2.0, 0.3], [5.0, 1.0, 5.0]]), 0.0)
    assert sample(probs, gen).tolist() == [1, 0]
    assert torch.equal(gen.get_state(), state)


def test_sample_is_reproducible_and_follows_probs() -> None:
    probs = torch.tensor([0.2, 0.0, 0.5, 0.3], dtype=F64)
    many = probs.expand(20_000, -1)
    draws = sample(many, torch.Generator().manual_seed(7))
    assert torch.equal(draws, sample(many, torch.Generator().manual_seed(7)))
    assert draws.shape == (20_000,)
    freq = torch.bincount(draws, minlength=4).to(F64) / 20_000
    sigma = (probs * (1 - probs) / 20_000).sqrt()
    assert ((freq - probs).abs() <= 4 * sigma + 1e-12).all(), freq
    assert sample(probs, torch.Generator().manual_seed(1)).shape == ()
