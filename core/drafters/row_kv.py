"""A drafter's serving KV cache with one length per row: per layer K/V [B, kv_heads, capacity, D] and
``lengths`` [B]. Row ``b`` holds its first ``lengths[b]`` slots; the slots after them are stale or empty and no
query ever reads them (:meth:`RowKV.key_mask`). EAGLE-3 and P-EAGLE keep one layer, DFlash one per draft layer.
"""

from __future__ import annotations

import torch

# (K, V) of one layer, each [B, kv_heads, T, D]
LayerKV = tuple[torch.Tensor, torch.Tensor]


class RowKV:
    """Per-row K/V for ``len(k)`` layers. ``name`` and ``unit`` word the errors ("drafter cache", "rows").

    The lengths live in a Python list (``held``): every call reads them to size its slices and masks, and a
    one-row call must cost what the single-length cache did (no tensor ops where every row is equally long)."""

    def __init__(
        self, k: list[torch.Tensor], v: list[torch.Tensor], *, name: str = "drafter cache", unit: str = "rows"
    ):
        if not k or len(k) != len(v) or any(t.shape != k[0].shape for t in (*k, *v)):
            raise ValueError("RowKV needs one K and one V tensor per layer, all [B, kv_heads, capacity, D]")
        self.k, self.v = k, v
        self.name, self.unit = name, unit
        self.held = [0] * k[0].shape[0]

    @classmethod
    def empty(
        cls, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, like: torch.Tensor, **names: str
    ) -> RowKV:
        """Zeroed K/V of ``like``'s dtype and device."""
        shape = (batch, kv_heads, capacity, head_dim)
        return cls(
            [like.new_zeros(shape) for _ in range(layers)], [like.new_zeros(shape) for _ in range(layers)], **names
        )

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    @property
    def lengths(self) -> torch.Tensor:
        """LongTensor [B]: the slots each row holds."""
        return torch.tensor(self.held, dtype=torch.long, device=self.device)

    @property
    def longest(self) -> int:
        """The most slots any row holds (the width of :meth:`view`)."""
        return max(self.held, default=0)

    @property
    def uniform(self) -> bool:
        """Whether every row holds as many slots."""
        return all(n == self.held[0] for n in self.held)

    @property
    def length(self) -> int:
        """The one length every row holds (the single-row API); refuses rows of different lengths."""
        if not self.uniform:
            raise ValueError(f"{self.name} rows hold different lengths {self.held}; read .lengths")
        return self.held[0]

    def counts(self, new: int, counts: torch.Tensor | list[int] | None) -> list[int]:
        """``counts`` [B] checked against a call of ``new`` rows per row (None: all ``new`` of every row)."""
        if counts is None:
            return [new] * self.batch
        counts = counts.reshape(-1).tolist() if isinstance(counts, torch.Tensor) else [int(n) for n in counts]
        if len(counts) != self.batch or any(not 0 <= n <= new for n in counts):
            raise ValueError(
                f"counts must be {self.batch} numbers in 0..{new} (real new {self.unit} per cache row), got {counts}"
            )
        return counts

    def append(self, kv: list[LayerKV], counts: torch.Tensor | list[int] | None = None) -> None:
        """Row ``b`` writes the first ``counts[b]`` of the ``T`` new rows of ``kv`` (per layer K, V [B, kv_heads,
        T, D]) at its slots ``lengths[b]..``; the rest of its rows (pads) are dropped. ``counts`` None: all T."""
        if len(kv) != len(self.k) or kv[0][0].shape[0] != self.batch:
            raise ValueError(
                f"{self.name}: append got {len(kv)} layers of {kv[0][0].shape[0]} rows but it holds "
                f"{len(self.k)} layers of {self.batch} rows"
            )
        new = kv[0][0].shape[2]
        counts = self.counts(new, counts)
        ends = [n + c for n, c in zip(self.held, counts)]
        if max(ends, default=0) > self.capacity:
            raise ValueError(
                f"{self.name} overflow: {max(ends)} {self.unit} needed, capacity {self.capacity}; "
                "build it with a larger max_len"
            )
        if self.uniform and all(c == new for c in counts):  # every row writes the same slots: slice copies
            start = self.held[0] if self.held else 0
            for (k, v), k_cache, v_cache in zip(kv, self.k, self.v):
                k_cache[:, :, start : start + new] = k
                v_cache[:, :, start : start + new] = v
        else:
            self._scatter(kv, counts)
        self.held = ends

    def _scatter(self, kv: list[LayerKV], counts: list[int]) -> None:
        """Ragged append: one index_put per tensor, (row, :, slot) <- (row, :, step) for every real row."""
        rows = torch.tensor([b for b, c in enumerate(counts) for _ in range(c)], dtype=torch.long)
        steps = torch.tensor([t for c in counts for t in range(c)], dtype=torch.long)
        slots = torch.tensor([self.held[b] + t for b, c in enumerate(counts) for t in range(c)], dtype=torch.long)
        rows, steps, slots = rows.to(self.device), steps.to(self.device), slots.to(self.device)
        for (k, v), k_cache, v_cache in zip(kv, self.k, self.v):
            k_cache[rows, :, slots] = k[rows, :, steps].to(k_cache.dtype)
            v_cache[rows, :, slots] = v[rows, :, steps].to(v_cache.dtype)

    def truncate(self, lengths: int | torch.Tensor | list[int]) -> None:
        """Keep the first ``lengths`` slots of every row (an int) or ``lengths[b]`` of row ``b``; never grows a row."""
        if isinstance(lengths, torch.Tensor):
            lengths = lengths.reshape(-1).tolist() if lengths.dim() else int(lengths)
        wanted = [int(lengths)] * self.batch if isinstance(lengths, int) else [int(n) for n in lengths]
        if len(wanted) != self.batch:
            raise ValueError(f"truncate {self.name} got {len(wanted)} lengths for {self.batch} rows")
        for row, (n, held) in enumerate(zip(wanted, self.held)):
            if not 0 <= n <= held:
                raise ValueError(f"truncate {self.name} row {row} to {n} but it holds {held} {self.unit}")
        self.held = wanted

    def view(self) -> list[LayerKV]:
        """Per layer K, V [B, kv_heads, longest, D]: every row's slots up to the longest row's (mask the rest with
        :meth:`key_mask`)."""
        end = self.longest
        return [(k[:, :, :end], v[:, :, :end]) for k, v in zip(self.k, self.v)]

    def key_mask(self, queries: int = 1) -> torch.Tensor:
        """bool [B, queries, longest]: True where the slot holds one of the row's rows."""
        held = torch.arange(self.longest, device=self.device) < self.lengths[:, None]
        return held[:, None].expand(self.batch, queries, held.shape[1])
