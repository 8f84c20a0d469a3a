"""A drafter's serving KV cache with one length per row: per layer K/V [B, kv_heads, capacity, D] and
``lengths`` [B]. Row ``b`` holds its first ``lengths[b]`` slots; the slots after them are stale or empty and no
query ever reads them (:meth:`RowKV.key_mask`). EAGLE-3 and P-EAGLE keep one layer, DFlash one per draft layer.
"""

from __future__ import annotations

import torch

# (K, V) of one layer, each [B, kv_heads, T, D]
LayerKV = tuple[torch.Tensor, torch.Tensor]


class RowKV:
    """Per-row K/V for ``len(k)`` layers. ``name`` and ``unit`` word the errors ("drafter cache", "rows")."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], *, name: str = "drafter cache",
                 unit: str = "rows"):
        if not k or len(k) != len(v) or any(t.shape != k[0].shape for t in (*k, *v)):
            raise ValueError("RowKV needs one K and one V tensor per layer, all [B, kv_heads, capacity, D]")
        self.k, self.v = k, v
        self.name, self.unit = name, unit
        self.lengths = torch.zeros(k[0].shape[0], dtype=torch.long, device=k[0].device)

    @classmethod
    def empty(cls, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, like: torch.Tensor,
              **names: str) -> RowKV:
        """Zeroed K/V of ``like``'s dtype and device."""
        shape = (batch, kv_heads, capacity, head_dim)
        return cls([like.new_zeros(shape) for _ in range(layers)], [like.new_zeros(shape) for _ in range(layers)],
                   **names)

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def longest(self) -> int:
        """The most slots any row holds (the width of :meth:`view`)."""
        return int(self.lengths.max()) if self.batch else 0

    @property
    def length(self) -> int:
        """The one length every row holds (the single-row API); refuses rows of different lengths."""
        first = int(self.lengths[0])
        if not bool((self.lengths == first).all()):
            raise ValueError(f"{self.name} rows hold different lengths {self.lengths.tolist()}; read .lengths")
        return first

    def counts(self, new: int, counts: torch.Tensor | None) -> torch.Tensor:
        """``counts`` [B] checked against a call of ``new`` rows per row (None: all ``new`` of every row)."""
        if counts is None:
            return torch.full_like(self.lengths, new)
        counts = torch.as_tensor(counts, dtype=torch.long, device=self.lengths.device).reshape(-1)
        if counts.shape[0] != self.batch or bool((counts < 0).any()) or bool((counts > new).any()):
            raise ValueError(f"counts must be {self.batch} numbers in 0..{new} (real new {self.unit} per cache row), "
                             f"got {counts.tolist()}")
        return counts

    def append(self, kv: list[LayerKV], counts: torch.Tensor | None = None) -> None:
        """Row ``b`` writes the first ``counts[b]`` of the ``T`` new rows of ``kv`` (per layer K, V [B, kv_heads,
        T, D]) at its slots ``lengths[b]..``; the rest of its rows (pads) are dropped. ``counts`` None: all T."""
        if len(kv) != len(self.k) or kv[0][0].shape[0] != self.batch:
            raise ValueError(f"{self.name}: append got {len(kv)} layers of {kv[0][0].shape[0]} rows but it holds "
                             f"{len(self.k)} layers of {self.batch} rows")
        new = kv[0][0].shape[2]
        counts = self.counts(new, counts)
        ends = self.lengths + counts
        if bool((ends > self.capacity).any()):
            need = int(ends.max())
            raise ValueError(f"{self.name} overflow: {need} {self.unit} needed, capacity {self.capacity}; build it "
                             "with a larger max_len")
        real = torch.arange(new, device=counts.device) < counts[:, None]  # [B, T]
        rows, steps = real.nonzero(as_tuple=True)
        slots = self.lengths[rows] + steps
        for (k, v), k_cache, v_cache in zip(kv, self.k, self.v):
            # index_put on [B, kv, S, D] with (row, :, slot): one scatter of every real row, pads never written
            k_cache[rows, :, slots] = k[rows, :, steps].to(k_cache.dtype)
            v_cache[rows, :, slots] = v[rows, :, steps].to(v_cache.dtype)
        self.lengths = ends

    def truncate(self, lengths: int | torch.Tensor) -> None:
        """Keep the first ``lengths`` slots of every row (an int) or ``lengths[b]`` of row ``b``; never grows a row."""
        wanted = torch.as_tensor(lengths, dtype=torch.long, device=self.lengths.device).expand(self.batch)
        short = (wanted < 0) | (wanted > self.lengths)
        if bool(short.any()):
            row = int(short.nonzero()[0])
            raise ValueError(f"truncate {self.name} row {row} to {int(wanted[row])} but it holds "
                             f"{int(self.lengths[row])} {self.unit}")
        self.lengths = wanted.clone()

    def view(self) -> list[LayerKV]:
        """Per layer K, V [B, kv_heads, longest, D]: every row's slots up to the longest row's (mask the rest with
        :meth:`key_mask`)."""
        end = self.longest
        return [(k[:, :, :end], v[:, :, :end]) for k, v in zip(self.k, self.v)]

    def key_mask(self, queries: int = 1) -> torch.Tensor:
        """bool [B, queries, longest]: True where the slot holds one of the row's rows."""
        held = torch.arange(self.longest, device=self.lengths.device) < self.lengths[:, None]
        return held[:, None].expand(self.batch, queries, held.shape[1])
