"""Drafter rows side by side: the EAGLE-3 drafter, its calls alone and in a batch, tree rows."""

from __future__ import annotations

import torch

from core.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from core.drafters.peagle import PEagleConfig, PEagleDrafter
from core.drafters.row_kv import RowKV

VOCAB, DRAFT_VOCAB, HIDDEN, TARGET_HIDDEN = 61, 47, 32, 24


SHAPE = dict(
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    draft_vocab_size=DRAFT_VOCAB,
    rope_theta=500.0,
)


def randomised(drafter, exact: bool):
    """Norm weights random too (ones would hide a norm applied to the wrong rows); eval, row-exact or not."""
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    drafter.eval().requires_grad_(False)
    drafter.set_row_exact(exact)
    return drafter


def eagle3(exact: bool, cls=Eagle3Drafter, **extra) -> Eagle3Drafter:
    torch.manual_seed(0)
    config_cls = PEagleConfig if cls is PEagleDrafter else Eagle3Config
    config = config_cls(**SHAPE, target_hidden_size=TARGET_HIDDEN, aux_layer_ids=[1, 2, 3], **extra)
    return randomised(cls(config, embed_weight=torch.randn(VOCAB, HIDDEN)), exact)


def same(batched: torch.Tensor, alone: torch.Tensor, exact: bool) -> None:
    """Bitwise in row-exact mode; else within fp32 rounding and with the same argmax."""
    if exact:
        assert torch.equal(batched, alone), f"max difference {(batched - alone).abs().max().item():.3g}"
        return
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)
    if batched.shape[-1] == DRAFT_VOCAB:
        assert torch.equal(batched.argmax(-1), alone.argmax(-1))


def padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """Row tensors [n_b, ...] right-padded with zeros to [B, max n_b, ...]."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


class Rows:
    """Random per-row inputs of a ragged call: ``counts[b]`` rows for row b."""

    def __init__(self, counts: list[int], width: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.counts = counts
        self.tokens = [torch.randint(0, VOCAB - 1, (n,), generator=generator) for n in counts]
        self.features = [torch.randn(n, width, generator=generator) for n in counts]

    def batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return padded(self.tokens), padded(self.features), torch.tensor(self.counts)


def batched_mask(kind: str, make, counts: torch.Tensor, cache: RowKV) -> torch.Tensor:
    """The [B, T, T] (short) or [B, T, P + T] (full) mask that gives row b ``make``'s mask for its count and length."""
    new, past = int(counts.max()), cache.longest
    mask = torch.zeros(counts.shape[0], new, new + (past if kind == "full" else 0), dtype=torch.bool)
    for b, (n, held) in enumerate(zip(counts.tolist(), cache.lengths.tolist())):
        if kind == "short":
            mask[b, :n, :n] = make(n)
        else:
            row = make(held, n)
            mask[b, :n, :held], mask[b, :n, past : past + n] = row[:, :held], row[:, held:]
    return mask


def eagle3_calls(drafter: Eagle3Drafter, cache: RowKV, calls: list[Rows], masks: list, row: int | None):
    """Run ``calls`` on ``cache``: every row at once (``row`` None) or row ``row`` alone (B = 1, its real rows
    only). ``masks[i]``: None (causal), ("short", n -> [n, n]) or ("full", (held, n) -> [n, held + n]), one row's
    mask. Returns each call's (logits, hidden)."""
    outputs = []
    with torch.no_grad():
        for rows_in, mask_of in zip(calls, masks):
            tokens, features, counts = rows_in.batch()
            if row is None:
                mask = None if mask_of is None else batched_mask(*mask_of, counts, cache)
            else:
                n, held = rows_in.counts[row], cache.length
                tokens, features, counts = tokens[row : row + 1, :n], features[row : row + 1, :n], None
                mask = (
                    None if mask_of is None else (mask_of[1](n) if mask_of[0] == "short" else mask_of[1](held, n))[None]
                )
            positions = cache.lengths[:, None] + torch.arange(tokens.shape[1])
            step = drafter.step(tokens, drafter.project(features), positions, cache, mask, counts)
            outputs.append((step.logits, step.hidden))
    return outputs


def tree_rows(held: int, n: int) -> torch.Tensor:
    """Full form: each new row sees its row's cache but the last held slot, row 0 and itself."""
    mask = torch.zeros(n, held + n, dtype=torch.bool)
    mask[:, : max(held - 1, 0)] = True
    mask[:, held] = True
    return mask


def siblings(n: int) -> torch.Tensor:
    """Short form: among the new rows each sees itself only (a tree level's siblings); the whole cache."""
    return torch.zeros(n, n, dtype=torch.bool)


def check_batched_rows_equal_solo(drafter: Eagle3Drafter, first_tokens: list[int], exact: bool, length: int) -> None:
    """Three calls (a first chain, then sibling rows under a short mask, then tree rows under a full one) on three
    ragged rows at once give each row what the same calls give it alone: bitwise in row-exact mode."""
    calls = [
        Rows(first_tokens, 3 * TARGET_HIDDEN, 1),
        Rows([3, 1, 2], 3 * TARGET_HIDDEN, 2),
        Rows([2, 3, 1], 3 * TARGET_HIDDEN, 3),
    ]
    masks = [None, ("short", siblings), ("full", tree_rows)]
    batched = eagle3_calls(drafter, drafter.new_cache(length, batch_size=3), calls, masks, None)
    for b in range(3):
        solo = eagle3_calls(drafter, drafter.new_cache(length), calls, masks, b)
        for (logits, hidden), (solo_logits, solo_hidden), rows_in in zip(batched, solo, calls):
            n = rows_in.counts[b]
            same(logits[b, :n], solo_logits[0], exact)
            same(hidden[b, :n], solo_hidden[0], exact)


@torch.no_grad()
def check_serving_chain_equals_training(
    drafter: Eagle3Drafter, ids: torch.Tensor, aux: torch.Tensor, trained, row: int, steps: int, cache_len: int
) -> None:
    """Serving rows 0..``row``, then j drafted rows each fed its own hidden state, gives step j of the training
    forward (``trained``) at ``row``: training-time test and serving are one computation."""
    cache = drafter.new_cache(cache_len)
    out = drafter.step(ids[:, 1 : row + 2], drafter.project(aux[:, : row + 1]), torch.arange(row + 1)[None], cache)
    logits, hidden = out.logits[:, -1:], out.hidden[:, -1:]
    torch.testing.assert_close(logits[0, 0], trained.logits[0][0, row], rtol=1e-5, atol=1e-5)
    for j in range(1, steps):
        if row + 1 + j >= ids.shape[1]:
            break
        out = drafter.step(ids[:, row + 1 + j : row + 2 + j], hidden, torch.tensor([[row + j]]), cache)
        logits, hidden = out.logits, out.hidden
        torch.testing.assert_close(logits[0, 0], trained.logits[j][0, row], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hidden[0, 0], trained.hidden[j][0, row], rtol=1e-5, atol=1e-5)
