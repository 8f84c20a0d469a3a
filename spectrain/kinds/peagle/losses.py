"""P-EAGLE training: COD sampling of the chain rows, the rows each step scores, and the loss.

Following vLLM's ``speculators`` 0.9.0 (``models/peagle/data.py:generate_cod_sample_indices``, ``metrics.py``):

* every position has its depth-0 row (EAGLE-3's row); depth-0 row ``q`` is scored when token ``q + 2`` is an answer
  token (``scored_rows``; speculators reads the same thing from its shifted ``loss_mask``);
* COD ("conditional drop") sampling of the deeper rows: the seeds are the scored rows (at most ``max_anchors`` of them,
  drawn uniformly); depth ``d`` keeps ``int((seeds - d) · max(r^d, r_min))`` rows drawn uniformly from the candidates
  (all of them when there are fewer), a row at position ``q`` of depth ``d`` belongs to the chain anchored at
  ``q - d``, and the candidates for depth ``d + 1`` are the kept rows shifted one position on that are scored too. So
  every chain row is scored, and depth ``d`` is ~``r^d`` as many rows as depth 0 (the geometric decay that bounds
  memory);
* loss = the mean KL(p_target ‖ q_draft) over every scored row of every depth (over the draft vocabulary), so depth
  ``d``'s weight is its share of the sampled rows. speculators divides by (rows + 1e-5).

Differences: the draws come from an injected ``torch.Generator`` (speculators: the global RNG; the same generator
state gives the same rows, ``tests/spectrain/test_peagle_speculators.py``), and a chain whose anchor would be before position 0
is dropped (speculators would index position -1).
"""

from __future__ import annotations

import torch

from core.drafters.eagle3 import shift_left
from core.drafters.peagle.attention import ChainLayout


def scored_rows(supervised: torch.Tensor) -> torch.Tensor:
    """[B, T] supervised tokens -> [B, T] depth-0 rows that carry a loss: row q predicts token q + 2."""
    return shift_left(supervised.bool(), 2, fill=False)


def cod_sample(
    scored: torch.Tensor,
    num_depths: int,
    ratio: float,
    ratio_min: float,
    max_anchors: int | None,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain rows of ONE sequence: ``scored`` [T] bool -> (anchors [N], depths [N] in 1..num_depths - 1), sorted by
    (anchor, depth). ``ratio`` = r, ``ratio_min`` = r_min (see the module docstring)."""
    scored = scored.bool().cpu()
    length = scored.numel()
    valid = scored.nonzero().flatten()
    seeds = valid
    if max_anchors is not None and len(valid) > max_anchors:
        seeds = valid[torch.randperm(len(valid), generator=generator)[:max_anchors]].sort().values
    candidates, anchors, depths = seeds, [], []
    for d in range(1, num_depths):
        size = int(max(0, len(seeds) - d) * max(ratio**d, ratio_min))
        if size <= 0:
            break
        kept = candidates
        if len(candidates) >= size:
            kept = candidates[torch.randperm(len(candidates), generator=generator)[:size]].sort().values
        following = (kept + 1) % length
        following = following[following != 0]
        candidates = following[torch.isin(following, valid)]
        inside = kept >= d  # a chain anchored before position 0 is dropped
        anchors.append(kept[inside] - d)
        depths.append(torch.full((int(inside.sum()),), d, dtype=torch.long))
    if not anchors:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    anchors_t, depths_t = torch.cat(anchors), torch.cat(depths)
    order = torch.argsort(anchors_t * num_depths + depths_t)
    return anchors_t[order], depths_t[order]


def every_chain(scored: torch.Tensor, num_depths: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain rows of ONE sequence for validation: every scored anchor ``a`` with each depth ``d`` whose rows
    ``a .. a + d`` are all scored (what serving drafts there, scored to its end), sorted by (anchor, depth)."""
    scored = scored.bool().cpu()
    length = scored.numel()
    run = torch.zeros(length + 1, dtype=torch.long)  # run[q]: scored rows from q on, consecutively
    for q in range(length - 1, -1, -1):
        run[q] = run[q + 1] + 1 if scored[q] else 0
    anchors = scored.nonzero().flatten()
    depth = torch.arange(1, num_depths)
    keep = depth[None, :] < run[anchors][:, None]  # [A, K - 1]
    a, d = keep.nonzero(as_tuple=True)
    return anchors[a], depth[d]


def batch_chains(
    per_row: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device | str, *, dense: bool = False
) -> ChainLayout:
    """Per-sequence (anchors, depths) -> one :class:`ChainLayout`, shorter rows padded at the front (anchor 0, depth
    1, not valid) so every row stays sorted."""
    width = max([len(a) for a, _ in per_row] + [0])
    anchors = torch.zeros(len(per_row), width, dtype=torch.long)
    depths = torch.ones(len(per_row), width, dtype=torch.long)
    valid = torch.zeros(len(per_row), width, dtype=torch.bool)
    for i, (a, d) in enumerate(per_row):
        if len(a):
            anchors[i, width - len(a) :], depths[i, width - len(a) :], valid[i, width - len(a) :] = a, d, True
    return ChainLayout(anchors.to(device), depths.to(device), valid.to(device), dense=dense)
