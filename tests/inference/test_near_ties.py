"""Greedy equality to AR where it can fail: every algorithm, in exact mode (fp32 and bf16), on a target whose every
greedy step is a near-tie (tests/near_ties.py), with a drafter that accepts. A control shows the tie is real: the
approximate path's multi-token verification leaves token-by-token AR on the same target."""

from __future__ import annotations

import pytest
import torch
from fitted_drafters import fit_dflash, fit_eagle3, fit_peagle, fit_specblock
from near_ties import TWINS, near_tie_llama

from core.drafters.hrad import HRAD, HRADConfig, HRADPredictor, capture_layers
from inference.algorithms import build_algorithm
from inference.device import cpu_has_native_bf16
from inference.runner import ModelRunner
from inference.sampling import SamplingParams

native_bf16 = pytest.mark.skipif(not cpu_has_native_bf16(), reason="needs a CPU with native bf16 (AVX512-BF16/AMX)")
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=native_bf16)]
GREEDY = SamplingParams(temperature=0)
PROMPT = torch.randint(0, 2 * TWINS, (30,), generator=torch.Generator().manual_seed(0)).tolist()
NEW = 40
# PEARL and SpecBranch check one draft token per target call after each rejection (pre-verify), and the approximate
# draft's twin choices are rejected often: a lower, still > 1, block efficiency.
MIN_TAU = {"pearl": 1.1, "specbranch": 1.1}


def runner(model, dtype: torch.dtype, exact: bool | None = None) -> ModelRunner:
    return ModelRunner.from_hf_model(model, dtype=dtype, max_seq_len=192, exact=exact)


@pytest.fixture(scope="module", params=DTYPES, ids=["fp32", "bf16"])
def served(request):
    """(dtype, target, AR's greedy tokens in exact mode, drafters fit to the sequence AR decodes), once per dtype."""
    dtype, threads = request.param, torch.get_num_threads()
    torch.set_num_threads(1)  # as every test gets (conftest); a module fixture is set up before that applies
    try:
        target = near_tie_llama(dtype)
        reference = build_algorithm("ar", runner(target, dtype)).generate(PROMPT, max_new_tokens=NEW, sampling=GREEDY)
        assert runner(target, dtype).exactness.bitwise
        sequence = PROMPT + reference.tokens
        drafters = {
            name: fit(target, sequence).to(dtype)
            for name, fit in (
                ("eagle3_tree", fit_eagle3),
                ("specblock_tree", fit_specblock),
                ("dflash", fit_dflash),
                ("peagle", fit_peagle),
            )
        }
    finally:
        torch.set_num_threads(threads)
    return dtype, target, reference.tokens, drafters


def test_the_ties_are_real_the_approximate_path_leaves_ar(served):
    """Control: with the same target and a draft that is the target itself, SpS on the approximate path (SDPA,
    batched GEMMs over each verified block) does not emit AR's tokens, where AR decodes one token per forward on
    that same path. The tests below would catch that path."""
    dtype, target, _, _ = served
    approximate = (
        build_algorithm("ar", runner(target, dtype, exact=False))
        .generate(PROMPT, max_new_tokens=NEW, sampling=GREEDY)
        .tokens
    )
    sps = build_algorithm("sps", runner(target, dtype, exact=False), runner(target, dtype, exact=False), gamma=4)
    result = sps.generate(PROMPT, max_new_tokens=NEW, sampling=GREEDY)
    assert result.stats.accepted_draft_tokens > 0
    first = next((i for i, (a, b) in enumerate(zip(result.tokens, approximate)) if a != b), None)
    assert first is not None, "the approximate path kept AR's tokens: the target has no effective near-tie"


@pytest.mark.parametrize(
    "name", ["sps", "pearl", "specbranch", "ssd", "self_draft", "eagle3_tree", "specblock_tree", "dflash", "peagle"]
)
def test_every_algorithm_equals_ar_on_near_ties_with_a_drafter_that_accepts(served, name):
    """The draft-LM algorithms draft with the target itself on the approximate path (it proposes the other twin
    wherever its rounding differs, so drafts are both kept and rejected); the feature drafters were fit to this
    prompt's continuation; Self-Draft reuses the n-grams of a continuation that repeats itself."""
    dtype, target, reference, drafters = served
    drafter, options = drafters.get(name), {}
    if name in ("sps", "pearl", "specbranch", "ssd"):
        drafter = runner(target, dtype, exact=False)
    if name == "specbranch":
        hidden, layers = target.config.hidden_size, target.config.num_hidden_layers
        options["hrad"] = HRADPredictor(
            HRAD(HRADConfig(hidden_size=hidden, last_k=4, gamma=4, boundaries=[1, 3])),
            {"layers": {"ids": capture_layers(layers, 4)}},
        )
    algorithm = build_algorithm(name, runner(target, dtype), drafter, **options)
    result = algorithm.generate(PROMPT, max_new_tokens=NEW, sampling=GREEDY)
    assert result.tokens == reference
    assert result.stats.accepted_draft_tokens > 0 and result.stats.tau > MIN_TAU.get(name, 1.5), result.stats
