"""The target's logits of one verification forward, row by row, computed only for the rows a walk reads.

A tree or trie walk reads the target's distribution at the root and at each accepted node: about τ rows of
the dozens the forward ran. On a CPU every lm_head call streams the whole weight (113 MB for SmolLM2's 49k
vocabulary, ≈ 12 ms, a sixth of a decode step) and a call over 24 rows cost ~3.5× one row here, so computing
just the rows read is cheaper (measured: +6 % tokens/s for Self-Draft at L = N = 6, +1 % for eagle3_tree with
48-node trees, where the 49-token decoder pass dominates); on a GPU one batched call over every row is cheaper
than a string of small ones (:func:`lazy_rows_on` picks). A row computed on demand goes through the runner's
``logits_from_hidden``, the very path its forward takes (in exact mode: a lone bf16 row doubled, at most
``EXACT_ROWS`` rows per call, the ``logit_vocab`` limit), so both give the same bits and a walk's output does not
depend on the choice. A runner whose forward scores every row anyway (the transformers fallback) hands its
forward's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

LogitsFromHidden = Callable[[Tensor], Tensor]  # a runner's logits_from_hidden: [n, H] final hidden -> fp32 [n, V]


class RowLogits:
    """Row ``r`` of a forward's logits (float32 [V]): from ``known`` (the rows computed with the forward, a
    prefix of them) or ``logits_from_hidden(hidden[r:r + 1])`` on first read (the runner's own method, module
    docstring), then cached. ``len`` = the number of rows."""

    def __init__(
        self, hidden: Tensor | None, logits_from_hidden: LogitsFromHidden | None, *, known: Tensor | None = None
    ):
        if hidden is None and known is None:
            raise ValueError("RowLogits needs the final hidden states or the computed logits")
        self.hidden, self.logits_from_hidden, self.known = hidden, logits_from_hidden, known
        self.num_rows = len(hidden) if hidden is not None else len(known)
        self.device = (hidden if hidden is not None else known).device
        self._rows: dict[int, Tensor] = {}

    @classmethod
    def computed(cls, logits: Tensor) -> RowLogits:
        """Every row already computed ([T, V])."""
        return cls(None, None, known=logits)

    def __len__(self) -> int:
        return self.num_rows

    @torch.no_grad()
    def __getitem__(self, row: int) -> Tensor:
        if not 0 <= row < self.num_rows:
            raise IndexError(f"row {row} of {self.num_rows}")
        if self.known is not None and row < len(self.known):
            return self.known[row]
        if row not in self._rows:
            self._rows[row] = self.logits_from_hidden(self.hidden[row : row + 1])[0]
        return self._rows[row]

    def stack(self, rows: Sequence[int]) -> Tensor:
        """Rows ``rows`` as one [n, V] tensor."""
        return torch.stack([self[r] for r in rows])


class WarpedRows:
    """``warp(rows[r])`` per row, computed on first read (warping all T × V rows would cost more than the
    forward on a CPU): what :func:`inference.verify.tree_walk` reads."""

    def __init__(self, rows: RowLogits, warp: Callable[[Tensor], Tensor]):
        self.rows, self.warp, self.device = rows, warp, rows.device
        self._cache: dict[int, Tensor] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, row: int) -> Tensor:
        if row not in self._cache:
            self._cache[row] = self.warp(self.rows[row])
        return self._cache[row]


def lazy_rows_on(runner) -> bool:
    """Compute verification logits row by row on a CPU, all at once elsewhere or where the runner's forward
    scores every row anyway (module docstring)."""
    return torch.device(runner.device).type == "cpu" and not runner.scores_every_row
