"""The EAGLE-3 drafter module: training-time test and serving are one computation; padding changes nothing."""

from __future__ import annotations

import pytest
import torch
from drafter_rows_helpers import check_serving_chain_equals_training

from core.drafters.eagle3 import Eagle3Config, Eagle3Drafter, shift_left


def drafter(norm_before_residual: bool = False) -> Eagle3Drafter:
    torch.manual_seed(0)
    config = Eagle3Config(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=53,
        draft_vocab_size=53,
        target_hidden_size=24,
        aux_layer_ids=[1, 2, 3],
        rope_theta=500.0,
        norm_before_residual=norm_before_residual,
    )
    module = Eagle3Drafter(config).eval()
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return module


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_training_time_test_equals_serving_a_chain(norm_before_residual):
    """Step j of the training forward at row i == serving rows 0..i, then j drafted rows fed their own hidden."""
    model = drafter(norm_before_residual)
    length, steps = 9, 4
    ids, aux = torch.randint(0, 53, (1, length)), torch.randn(1, length, 72)
    with torch.no_grad():
        trained = model(ids, aux, steps=steps)
    for row in (0, 3, 4):
        check_serving_chain_equals_training(model, ids, aux, trained, row, steps, cache_len=32)


def test_padding_does_not_change_real_rows():
    model = drafter()
    ids, aux = torch.randint(1, 53, (2, 7)), torch.randn(2, 7, 72)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    with torch.no_grad():
        batched = model(ids, aux, steps=3, attention_mask=mask)
        alone = model(ids[1:, :4], aux[1:, :4], steps=3)
    for j in range(3):
        valid = 4 - 1 - j  # rows whose input token is still inside the short sequence
        torch.testing.assert_close(batched.logits[j][1, :valid], alone.logits[j][0, :valid], rtol=1e-5, atol=1e-5)


def test_shift_left_and_config_errors():
    x = torch.tensor([[1, 2, 3, 4]])
    assert shift_left(x, 0).tolist() == [[1, 2, 3, 4]] and shift_left(x, 1, fill=-1).tolist() == [[2, 3, 4, -1]]
    assert shift_left(x, 9).tolist() == [[0, 0, 0, 0]]
    with pytest.raises(ValueError, match="EAGLE-3 needs 3 non-negative aux layer ids"):
        Eagle3Config(32, 64, 4, 2, 53, 53, 24, aux_layer_ids=[1, 2])
    with pytest.raises(ValueError, match="draft_vocab_size 60 exceeds the target vocab_size 53"):
        Eagle3Config(32, 64, 4, 2, 53, 60, 24, aux_layer_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="unknown eagle3 config fields \\['layers'\\]"):
        Eagle3Config.from_dict({**drafter().config.to_dict(), "layers": 2})
    with pytest.raises(ValueError, match=r"target embedding is \(53, 16\) but this drafter needs \(53, 32\)"):
        drafter().use_target_embedding(torch.zeros(53, 16))
    with pytest.raises(ValueError, match="d2t \\+ arange != nonzero\\(t2d\\)"):
        model = drafter()
        model.set_vocab_map(torch.ones(53, dtype=torch.long), torch.ones(53, dtype=torch.bool))
