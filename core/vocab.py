"""The EAGLE-3 reduced draft vocabulary map: ``d2t`` / ``t2d``, built from token counts, saved and loaded.

- ``d2t`` int64 [K]: offsets, ``target_id = draft_id + d2t[draft_id]`` (i.e. ``d2t[i] = used[i] - i``);
- ``t2d`` bool [V]: ``t2d[v] = v in used`` over the target vocabulary.

Both the writer and the loader check ``d2t + arange(K) == nonzero(t2d)``. ``python -m data_prep.vocab`` counts
the tokens and writes the map.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from core.assets import load_safetensors
from core.errors import UserError


def check_vocab_mapping(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Raise ValueError (one line) unless ``d2t + arange == nonzero(t2d)`` (SpecForge's consistency check)."""
    if d2t.dim() != 1 or t2d.dim() != 1 or t2d.dtype != torch.bool:
        raise UserError(
            f"vocab map must be d2t [K] and bool t2d [V], got {tuple(d2t.shape)} and {tuple(t2d.shape)} {t2d.dtype}"
        )
    used = torch.nonzero(t2d).flatten()
    if used.numel() != d2t.numel():
        raise UserError(f"vocab map is inconsistent: t2d marks {used.numel()} tokens but d2t has {d2t.numel()}")
    if not torch.equal(d2t.long() + torch.arange(d2t.numel()), used):
        raise UserError(
            "vocab map is inconsistent: d2t + arange != nonzero(t2d); rebuild it with python -m data_prep.vocab"
        )


def build_vocab_map(counts: np.ndarray, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` keeping the ``draft_vocab_size`` most frequent ids of ``counts`` [V]."""
    vocab = len(counts)
    if not 1 <= draft_vocab_size <= vocab:
        raise UserError(f"draft_vocab_size must be in 1..{vocab} (the target vocabulary), got {draft_vocab_size}")
    # Stable sort on -count: equal counts keep id order, so ties go to the lower id (and zero-count fill-ins
    # are the lowest unused ids).
    order = np.argsort(-counts.astype(np.int64), kind="stable")
    used = np.sort(order[:draft_vocab_size])
    d2t = torch.from_numpy(used - np.arange(draft_vocab_size)).long()
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.from_numpy(used)] = True
    check_vocab_mapping(d2t, t2d)
    return d2t, t2d


def save_vocab_map(path: str | Path, d2t: torch.Tensor, t2d: torch.Tensor, metadata: dict[str, str]) -> None:
    """Write ``{d2t, t2d}`` as safetensors, atomically (temporary file + rename)."""
    from safetensors.torch import save_file  # safetensors: a heavy import, deferred to first use

    check_vocab_mapping(d2t, t2d)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    try:
        save_file(
            {"d2t": d2t.contiguous(), "t2d": t2d.contiguous()},
            tmp,
            metadata={"format": "spectrain.vocab_map", **{k: str(v) for k, v in metadata.items()}},
        )
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_vocab_map(path: str | Path) -> tuple[torch.Tensor, torch.Tensor, dict[str, str]]:
    """``(d2t, t2d, metadata)``; refuses (one line) a missing, damaged or inconsistent map."""

    fix = "rebuild it with python -m data_prep.vocab"
    tensors, metadata = load_safetensors(path, fix=fix, with_metadata=True)
    if "d2t" not in tensors or "t2d" not in tensors:
        raise UserError(f"{path} is not a vocabulary map (no d2t/t2d tensors); {fix}")
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    check_vocab_mapping(d2t, t2d)
    return d2t, t2d, metadata
