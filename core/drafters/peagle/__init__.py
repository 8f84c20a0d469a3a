"""The P-EAGLE drafter (parallel EAGLE): EAGLE-3's drafter plus a learnt ``mask_hidden`` and a ``mask_token_id``, so
that ONE forward drafts ``K`` tokens (vLLM's ``speculators`` 0.9.0 ``models/peagle``; vLLM serves it as
``speculators_model_type: peagle``).

Architecture: :mod:`core.drafters.eagle3` (the same ``fc``, ``midlayer``, ``norm``, ``lm_head``, vocabulary map), and::

    depth-0 row at position i  = EAGLE-3's row i: (token i + 1, fc(target features at i))  -> predicts token i + 2
    depth-d row at anchor a    = (mask_token_id, fc(mask_hidden)) at position a + d         -> predicts token a + d + 2

A depth-``d`` row reads neither the token drafted at depth ``d - 1`` nor its hidden state: the mask embedding and
``mask_hidden`` stand in for both, so all ``K`` depths of a chain come out of one forward. Attention: a depth-0 row
sees the depth-0 rows before it (EAGLE-3's causal rows); a depth-``d`` row sees the depth-0 rows ``<= a`` and the rows
of its own chain of depth ``<= d`` (:mod:`core.drafters.peagle.attention`).

Serving (:meth:`PEagleDrafter.draft`): the committed rows are cached (EAGLE-3's cache); per round the newly committed
rows and ``K - 1`` mask rows after the last one run as ONE causal step against the cache (a causal mask over cache +
new rows is exactly the chain's mask, since every cached row is a depth-0 row ``<= a``), the last committed row's
logits draft token ``n + 1`` and the mask rows' the next ``K - 1``; the mask rows' K/V are dropped again. Training
(:meth:`PEagleDrafter.forward`) runs every position's depth-0 row and the COD-sampled chain rows in one forward. Both
call :meth:`Eagle3Drafter._rows`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from core.drafters.eagle3 import NUM_AUX_LAYERS, Eagle3Cache, Eagle3Config, Eagle3Drafter, shift_left
from core.drafters.peagle.attention import ChainLayout

KIND = "peagle"


@dataclass(kw_only=True)
class PEagleConfig(Eagle3Config):
    """An EAGLE-3 drafter's fields plus the mask token and the number of depths one forward drafts."""

    KIND = "P-EAGLE"

    mask_token_id: int  # the token every depth >= 1 row reads (a special token the data never holds)
    num_depths: int = 8  # K: tokens one forward drafts (speculators' num_depths; vLLM's num_speculative_tokens)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fc_norm or self.norm_output:  # its layouts carry neither: refused rather than dropped on export
            raise ValueError(
                "P-EAGLE runs without EAGLE-3.1's fc_norm and norm_output; set both false (they are "
                "options of kind=eagle3)"
            )
        if self.num_depths < 1:
            raise ValueError(f"P-EAGLE num_depths must be >= 1 (tokens one forward drafts), got {self.num_depths}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is not a token id of the {self.vocab_size}-token "
                "vocabulary; pick an unused or special token of the target's tokenizer"
            )


@dataclass
class PEagleOutput:
    """Pre-norm hidden states of the depth-0 rows [B, T, H] and of the chain rows [B, N, H] (apply ``head``)."""

    hidden: torch.Tensor
    chain_hidden: torch.Tensor


class PEagleDrafter(Eagle3Drafter):
    """The P-EAGLE drafter; see the module docstring for the rows, the attention and serving."""

    config: PEagleConfig

    def __init__(self, config: PEagleConfig, embed_weight: torch.Tensor | None = None):
        super().__init__(config, embed_weight)
        # the features every depth >= 1 row reads, before fc; random like the library's (torch.randn)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, NUM_AUX_LAYERS * config.target_hidden_size))

    def mask_rows(self, count: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [1, count], fc'd hidden [1, count, H]) of ``count`` depth >= 1 rows."""
        tokens = torch.full((1, count), self.config.mask_token_id, dtype=torch.long, device=self.fc.weight.device)
        return tokens, self.fc(self.mask_hidden.to(dtype)).expand(1, count, -1)

    # -- training --------------------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, chains: ChainLayout) -> PEagleOutput:
        """Every position's depth-0 row and the ``chains`` rows, one forward.

        ``input_ids`` [B, T] and ``aux_hidden`` [B, T, 3·H_t] are unshifted (as ``data_prep.features`` stores them;
        right-padded: causal rows never read the padding). Row i of depth 0 predicts token i + 2; chain row n
        (anchor a, depth d) predicts token a + d + 2."""
        if self.config.attention_window:  # its chain attention (core.drafters.peagle.attention) has none: refused
            raise ValueError(
                f"P-EAGLE trains without a sliding window; this drafter sets attention_window="
                f"{self.config.attention_window} (serving honours it): train with attention_window=0"
            )
        batch, length = input_ids.shape
        dtype = self.fc.weight.dtype
        tokens, hidden = self.mask_rows(chains.rows, dtype)
        tokens = torch.cat([shift_left(input_ids, 1), tokens.expand(batch, -1)], dim=1)
        hidden = torch.cat([self.fc(aux_hidden.to(dtype)), hidden.expand(batch, -1, -1)], dim=1)
        rows = torch.arange(length, device=input_ids.device).expand(batch, length)
        positions = torch.cat([rows, chains.positions()], dim=1)
        _, out, _, _ = self._rows(tokens, hidden, positions, None, None, chains.attend, heads=False)
        return PEagleOutput(out[:, :length], out[:, length:])

    # -- serving ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def draft(
        self,
        cache: Eagle3Cache,
        features: torch.Tensor,
        next_tokens: list[int] | torch.Tensor,
        depths: int | None = None,
        counts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """For each of the cache's B rows: append the rows of its newly committed positions (``features`` [B, n,
        3·H_t] of the positions right after those the row caches, each paired with the token after it,
        ``next_tokens`` [B, n], a list of n for one row), then draft ``depths`` (default K) tokens after the last of
        them. ``counts`` [B]: row b's first ``counts[b]`` positions are real (ragged rows, right-padded; None: all
        n; 0: the row is left as it is and its logits are meaningless). Returns the drafts' logits over the draft
        vocabulary [B, depths, Vd]."""
        depths = depths or self.config.num_depths
        if not 1 <= depths <= self.config.num_depths:
            raise ValueError(f"draft depths={depths} but this drafter drafts 1..{self.config.num_depths}")
        batch, new = features.shape[:2]
        next_tokens = torch.as_tensor(next_tokens, dtype=torch.long, device=self.fc.weight.device)
        if new < 1 or next_tokens.numel() != batch * new:
            raise ValueError(
                f"draft needs >= 1 committed row and one next token per row, got {new} rows and "
                f"{next_tokens.numel()} tokens for {batch} cache rows"
            )
        counts = cache.counts(new, counts)
        start = list(cache.held)
        tokens, hidden = self._draft_rows(features, next_tokens.view(batch, new), counts, depths)
        positions = torch.tensor(start, device=tokens.device)[:, None] + torch.arange(
            tokens.shape[1], device=tokens.device
        )
        step = self.step(tokens, hidden, positions, cache, counts=[c + depths - 1 if c else 0 for c in counts])
        cache.truncate([n + c for n, c in zip(start, counts)])  # the mask rows are this round's only
        if all(c == new for c in counts):  # every row's drafts sit in the same columns
            return step.logits[:, new - 1 :]
        first = torch.tensor([max(c - 1, 0) for c in counts], device=tokens.device)[:, None]
        rows = first + torch.arange(depths, device=tokens.device)  # [B, depths]
        return step.logits.gather(1, rows[..., None].expand(-1, -1, step.logits.shape[-1]))

    def _draft_rows(
        self, features: torch.Tensor, next_tokens: torch.Tensor, counts: list[int], depths: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [B, n + depths - 1] and hidden [B, n + depths - 1, H] of a draft call: per row its ``counts[b]``
        committed rows, then ``depths - 1`` mask rows, then pads."""
        batch, new = next_tokens.shape
        if all(c == new for c in counts):  # no pads: every row's mask rows follow its n committed ones
            mask_tokens, mask_hidden = self.mask_rows(depths - 1, self.fc.weight.dtype)
            return torch.cat([next_tokens, mask_tokens.expand(batch, -1)], dim=1), torch.cat(
                [self.project(features.to(mask_hidden.dtype)), mask_hidden.expand(batch, -1, -1)], dim=1
            )
        _, mask_hidden = self.mask_rows(1, self.fc.weight.dtype)
        slot = torch.arange(new + depths - 1, device=next_tokens.device)[None]
        real = torch.tensor(counts, device=next_tokens.device)[:, None]
        masked = (slot >= real) & (slot < real + depths - 1)  # [B, width]
        tokens = F.pad(next_tokens, (0, depths - 1)).masked_fill(masked, self.config.mask_token_id)
        hidden = F.pad(self.project(features.to(mask_hidden.dtype)), (0, 0, 0, depths - 1))
        return tokens, torch.where(masked[..., None], mask_hidden, hidden)
