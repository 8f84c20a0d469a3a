"""What feature-conditioned drafters (EAGLE-3, SpecBlock) share: the target's frozen token embedding, a reduced
draft vocabulary (``d2t`` / ``t2d``, ``data_prep.vocab``) and RoPE frequencies kept in fp32."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from core.blocks.rope import rope_cos_sin, rope_inv_freq
from core.vocab import check_vocab_mapping


class TargetTiedDrafter(nn.Module):
    """Base of drafters that embed with the target's matrix and predict over a reduced vocabulary.

    Subclasses call ``_init_target_tied(config, embed_weight)`` first in ``__init__``; ``config`` needs
    ``vocab_size``, ``hidden_size``, ``draft_vocab_size``, ``rms_norm_eps``, ``llama_config()`` and
    ``resolved_head_dim``."""

    config: Any

    def _init_target_tied(self, config: Any, embed_weight: torch.Tensor | None) -> None:
        self.config = config
        if embed_weight is not None:
            self._check_embedding(embed_weight)
        # With _weight the target's matrix is used as-is: shared storage, no random init of a V x H copy.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embed_weight)
        self.embed_tokens.weight.requires_grad_(False)
        # Identity-like default map (the first Vd target ids); set_vocab_map installs the trained one.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        # A plain fp32 attribute, not a buffer: module.to(bfloat16) must not round the RoPE frequencies
        # (and on CPU even when the module is built on the meta device).
        with torch.device("cpu"):
            self._inv_freq, self.rope_scale = rope_inv_freq(config.llama_config(), config.resolved_head_dim)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, D] at ``positions`` [B, T]; the fp32 frequencies follow ``positions`` to its device."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        return rope_cos_sin(positions, self._inv_freq, self.rope_scale, dtype)

    def _check_embedding(self, weight: torch.Tensor) -> None:
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != expected:
            raise ValueError(f"target embedding is {tuple(weight.shape)} but this drafter needs {expected} "
                             "(vocab_size, hidden_size); it was trained for another target")

    def use_target_embedding(self, weight: torch.Tensor) -> None:
        """Share the target's embedding matrix (frozen); refuses a shape that does not fit this drafter."""
        self._check_embedding(weight)
        self.embed_tokens.weight = nn.Parameter(weight, requires_grad=False)

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install a reduced vocabulary (``data_prep.vocab`` output); refuses an inconsistent map."""
        if d2t.numel() != self.config.draft_vocab_size or t2d.numel() != self.config.vocab_size:
            raise ValueError(f"vocab map has {d2t.numel()} draft / {t2d.numel()} target ids but the drafter has "
                             f"draft_vocab_size={self.config.draft_vocab_size}, vocab_size={self.config.vocab_size}")
        check_vocab_mapping(d2t.cpu(), t2d.cpu())
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def draft_ids_in_target(self) -> torch.Tensor:
        """[Vd] the target id of every draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t
