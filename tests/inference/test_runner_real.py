"""The runner on the real embedded SmolLM2: logits equal transformers', also after commit and truncate."""

from __future__ import annotations

import pytest
import torch

from inference.runner import ModelRunner

pytestmark = pytest.mark.real_model
ATOL = 2e-3  # fp32, 30 layers: observed max |diff| ~1e-4; logits range ~±30


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_smollm2_logits_match_transformers_through_commit_and_truncate(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer("Speculative decoding keeps the target's output exactly.")["input_ids"]
    runner = ModelRunner.from_hf_model(model, max_seq_len=128)
    reference = hf_logits(model, ids + [11, 12, 13, 14])

    prefill = runner.forward(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill, reference[: len(ids)], atol=ATOL, rtol=0)

    # A chain of 4 drafted tokens, of which the first 2 are committed.
    chain = runner.forward(torch.tensor([[11, 12, 13, 14]])).logits[0]
    torch.testing.assert_close(chain, reference[len(ids) :], atol=ATOL, rtol=0)
    runner.commit(torch.tensor([[0, 1]]))
    after_commit = runner.forward(torch.tensor([[20]])).logits[0, -1]
    torch.testing.assert_close(after_commit, hf_logits(model, ids + [11, 12, 20])[-1], atol=ATOL, rtol=0)

    runner.truncate(len(ids) + 1)
    after_truncate = runner.forward(torch.tensor([[30, 31]])).logits[0]
    torch.testing.assert_close(after_truncate, hf_logits(model, ids + [11, 30, 31])[-2:], atol=ATOL, rtol=0)


def test_smollm2_hidden_capture_matches_output_hidden_states(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer("Hidden states for EAGLE-3 features.")["input_ids"]
    runner = ModelRunner.from_hf_model(model, max_seq_len=64)
    out = runner.forward(torch.tensor([ids]), capture_layers=(1, 14, 26), return_last_hidden=True)
    with torch.no_grad():
        hf = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    # rtol: exact mode's own RMSNorm scale and fp32 GEMMs over rows padded to a multiple of 4 round the last bit
    # differently from transformers' ops; SmolLM2 carries activations of ~25,000 in a few features
    for layer in (1, 14, 26):  # output of decoder layer i == hidden_states[i + 1]
        torch.testing.assert_close(out.hidden[layer][0], hf[layer + 1][0], atol=ATOL, rtol=1e-6)
    torch.testing.assert_close(model.lm_head(out.last_hidden)[0], out.logits[0], atol=ATOL, rtol=1e-6)
