"""What feature-conditioned drafters (EAGLE-3, SpecBlock) share: the target's frozen token embedding, a reduced
draft vocabulary (``d2t`` / ``t2d``, ``data_prep.vocab``), RoPE frequencies kept in fp32, and the switch of the
row-exact serving mode."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from core.blocks.linear import Linear
from core.blocks.mlp import MLP
from core.blocks.norm import RMSNorm
from core.blocks.rope import rope_cos_sin, rope_inv_freq
from core.kernels import exact_cpu
from core.vocab import check_vocab_mapping

ROPE_TABLE_MIN = 256  # positions of the first row-exact RoPE table; it doubles as positions grow


class TargetTiedDrafter(nn.Module):
    """Base of drafters that embed with the target's matrix and predict over a reduced vocabulary.

    Subclasses call ``_init_target_tied(config, embed_weight)`` first in ``__init__``; ``config`` needs
    ``vocab_size``, ``hidden_size``, ``draft_vocab_size``, ``rms_norm_eps``, ``llama_config()`` and
    ``resolved_head_dim``."""

    config: Any
    # Whether the serving calls run one attention per row (a subclass that does sets it True).
    ROW_EXACT_SERVING: ClassVar[bool] = False
    row_exact: bool = False

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
        """cos, sin [B, 1, T, D] at ``positions`` [B, T]; the fp32 frequencies follow ``positions`` to its device.
        Row-exact: read from a table where each position's angles were computed once."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        if self.row_exact:
            return self._rope_from_table(positions, dtype)
        return rope_cos_sin(positions, self._inv_freq, self.rope_scale, dtype)

    def _rope_from_table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # A vectorised cos computes a tensor's tail apart, so an angle's bits can depend on where it sits in the
        # call: the table computes each position once and only appends (old entries are never recomputed).
        table = self.__dict__.get("_rope_table")
        have = 0 if table is None else table[0].shape[0]
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > have:
            grown = max(need, 2 * have, ROPE_TABLE_MIN)
            cos, sin = rope_cos_sin(
                torch.arange(have, grown, device=positions.device)[None], self._inv_freq, self.rope_scale, torch.float32
            )
            table = (
                (cos[0, 0], sin[0, 0])
                if table is None
                else (torch.cat([table[0], cos[0, 0]]), torch.cat([table[1], sin[0, 0]]))
            )
            self.__dict__["_rope_table"] = table
        return table[0][positions][:, None].to(dtype), table[1][positions][:, None].to(dtype)

    def set_row_exact(self, on: bool = True) -> None:
        """Row-exact serving on a CPU (fp32; bf16 where the host's linears are row-exact): each row of a batched
        serving call gets bitwise the logits and hidden states it gets called alone, whoever shares the call.
        Linears, RMSNorm's scale and SiLU run in ``core.kernels.exact_cpu``, RoPE reads a per-position table and
        attention runs one call per row over exactly that row's keys. Off restores torch's kernels."""
        if on:
            if not self.ROW_EXACT_SERVING:
                raise ValueError(f"{type(self).__name__} has no row-exact serving mode; serve it with row_exact off")
            if self.fc.weight.device.type != "cpu":
                raise ValueError(
                    f"row-exact serving runs on a CPU, this drafter is on {self.fc.weight.device}; "
                    "move it to the CPU or leave row_exact off"
                )
            if self.config.hidden_act != "silu":
                raise ValueError(
                    f"row-exact serving computes SiLU, this drafter's MLP uses {self.config.hidden_act}; "
                    "leave row_exact off"
                )
            exact_cpu.library()  # raises KernelUnavailable with the reason before anything is switched
        for module in self.modules():
            if isinstance(module, (Linear, RMSNorm, MLP)):
                module.exact = on
        self.row_exact = on

    def _check_embedding(self, weight: torch.Tensor) -> None:
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != expected:
            raise ValueError(
                f"target embedding is {tuple(weight.shape)} but this drafter needs {expected} "
                "(vocab_size, hidden_size); it was trained for another target"
            )

    def use_target_embedding(self, weight: torch.Tensor) -> None:
        """Share the target's embedding matrix (frozen); refuses a shape that does not fit this drafter."""
        self._check_embedding(weight)
        self.embed_tokens.weight = nn.Parameter(weight, requires_grad=False)

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install a reduced vocabulary (``data_prep.vocab`` output); refuses an inconsistent map."""
        if d2t.numel() != self.config.draft_vocab_size or t2d.numel() != self.config.vocab_size:
            raise ValueError(
                f"vocab map has {d2t.numel()} draft / {t2d.numel()} target ids but the drafter has "
                f"draft_vocab_size={self.config.draft_vocab_size}, vocab_size={self.config.vocab_size}"
            )
        check_vocab_mapping(d2t.cpu(), t2d.cpu())
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def draft_ids_in_target(self) -> torch.Tensor:
        """[Vd] the target id of every draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t
