"""Forwards over chosen rows of a runner's batch, for the engine loop and the strategies' draft runners.

Rows are slots: row ``b`` of the target runner (and of a draft LM's runner) belongs to one request while it runs. A
step feeds each busy row its own tokens, right-padded to the widest row; idle rows carry pads. After the forward
every row is rolled back to what it really read (pads never stay in a cache), and the logits come back per row, at
the positions each row asked for.

Logits are taken the cheapest way that gives every row the bits of its own forward: when every busy row reads its
whole feed, or only its last token, and all feeds are as wide, straight from the forward (what a one-request run
asks); otherwise the forward scores no rows and ``logits_from_hidden`` scores the gathered rows, which in exact mode
is the forward's own lm_head path (``inference.runner_contract``) and costs only the rows that are used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from core.errors import UserError
from inference.runner_contract import RunnerOutput
from inference.tree import DraftTree

PAD_ID = 0  # any valid id: a pad is rolled back before anything that counts reads it

Feed = Sequence[int] | None  # a row's new tokens; None = an idle row, [] = a row that sits this forward out


@dataclass
class RowsOutput:
    """``logits[b]``: float32 [k_b, V] at the positions row ``b`` asked for (None for an idle row); ``forward``:
    the runner's own output (captured layers [B, W, H], ``last_hidden``)."""

    logits: list[torch.Tensor | None]
    forward: RunnerOutput


def forward_rows(
    runner,
    feeds: Sequence[Feed],
    wanted: Sequence[Sequence[int] | None],
    *,
    capture_layers: Sequence[int] = (),
    return_last_hidden: bool = False,
    trees: Sequence[DraftTree | None] | None = None,
    commit: Callable[[RowsOutput], Sequence[Sequence[int]]] | None = None,
) -> RowsOutput:
    """Feed rows ``0..len(feeds)-1`` of ``runner``'s batch their tokens in one forward; ``wanted[b]`` lists the
    positions (into row b's feed) whose logits row b needs. Rows after ``len(feeds)`` sit out; each row ends holding
    its cached tokens plus its feed (an idle row: nothing).

    ``trees[b]`` (a draft tree, or None for a chain): row b's feed is its pending tokens then the tree's nodes,
    scored under the row's ancestor mask at positions ``committed + depth`` (:func:`tree_feed`). ``commit``
    (trees) is called with the output inside the forward's row view and returns the indices of its feed each row
    keeps (idle rows: none), which ``runner.commit`` keeps; without it each row keeps its whole feed."""
    n = len(feeds)
    busy = [b for b, feed in enumerate(feeds) if feed]
    if not busy:
        raise ValueError("forward_rows needs at least one row with tokens")
    # None: an idle row (emptied); []: a row that sits out (it keeps its cache, reads pads, is rolled back)
    width = max(len(feeds[b]) for b in busy)
    ids = torch.full((n, width), PAD_ID, dtype=torch.long)
    for b in busy:
        ids[b, : len(feeds[b])] = torch.tensor(list(feeds[b]), dtype=torch.long)
    fed = torch.tensor([len(feed) if feed else 0 for feed in feeds], dtype=torch.long, device=runner.device)
    with _first_rows(runner, n):
        idle = torch.tensor([feed is None for feed in feeds], device=runner.device)
        if bool(idle.any()):  # an idle row's stale cache must not grow past its room
            runner.truncate(torch.where(idle, 0, runner.cache_lens))
        before = runner.cache_lens.clone()
        shape = {}
        if trees is not None and any(tree is not None for tree in trees):
            shape = dict(zip(("positions", "attention_mask"), _tree_shape(feeds, trees, before, width)))
            shape = {key: value.to(runner.device) for key, value in shape.items()}
        uniform = all(len(feeds[b]) == width for b in busy)
        if uniform and all(list(wanted[b]) == [width - 1] for b in busy):
            out = runner.forward(
                ids.to(runner.device),
                only_last_logits=True,
                capture_layers=capture_layers,
                return_last_hidden=return_last_hidden,
                **shape,
            )
            logits = [out.logits[b].float() if feeds[b] else None for b in range(n)]
        elif runner.scores_every_row or (uniform and all(list(wanted[b]) == list(range(width)) for b in busy)):
            out = runner.forward(
                ids.to(runner.device), capture_layers=capture_layers, return_last_hidden=return_last_hidden, **shape
            )
            logits = [out.logits[b, list(wanted[b])].float() if feeds[b] else None for b in range(n)]
        else:
            out = runner.forward(
                ids.to(runner.device),
                logit_rows=slice(0, 0),
                capture_layers=capture_layers,
                return_last_hidden=True,
                **shape,
            )
            logits = _score_rows(runner, out.last_hidden, feeds, wanted)
        result = RowsOutput(logits, out)
        if commit is None:
            runner.truncate(before + fed)
        else:
            runner.commit([list(kept) for kept in commit(result)])
    return result


def tree_feed(pending: int, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
    """A row fed ``pending`` tokens then ``tree``'s nodes: each token's offset from the row's cache length
    (LongTensor [pending + N]: pending token i at i, a node at ``pending - 1 + depth``) and its short-form mask
    (bool [pending + N, pending + N]: the pending tokens causally; a node sees them, its ancestors and itself)."""
    size = pending + len(tree)
    mask = torch.zeros(size, size, dtype=torch.bool)
    mask[:pending, :pending] = _causal(pending)
    mask[pending:, :pending] = True
    for node, parent in enumerate(tree.parents):
        row = pending + node
        mask[row, row] = True
        if parent >= 0:  # parents come first, so their rows are already complete
            mask[row, pending:row] |= mask[pending + parent, pending:row]
    offsets = torch.tensor([*range(pending), *(pending - 1 + d for d in tree.depths)], dtype=torch.long)
    return offsets, mask


def _causal(size: int) -> torch.Tensor:
    """Bool [size, size], lower triangular. Not ``tril``: on a busy CPU its call takes milliseconds (it wakes the
    intra-op threads even for a 2 x 2 matrix), a comparison of two ranges microseconds."""
    steps = torch.arange(size)
    return steps[:, None] >= steps[None, :]


def _tree_shape(
    feeds: Sequence[Feed], trees: Sequence[DraftTree | None], before: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [B, W] and short-form mask [B, W, W] of a forward where some rows feed trees: chains read
    causally, a tree row as :func:`tree_feed` says, and pads see only themselves (their outputs are never read)."""
    batch = len(feeds)
    positions = before.cpu()[:, None] + torch.arange(width)[None]
    mask = torch.eye(width, dtype=torch.bool).repeat(batch, 1, 1)
    for b, feed in enumerate(feeds):
        if not feed:
            continue
        size = len(feed)
        tree = trees[b] if b < len(trees) else None
        if tree is None:
            mask[b, :size, :size] = _causal(size)
            continue
        offsets, row_mask = tree_feed(size - len(tree), tree)
        positions[b, :size] = before[b].item() + offsets
        mask[b, :size, :size] = row_mask
    return positions, mask


def _score_rows(
    runner, last_hidden: torch.Tensor, feeds: Sequence[Feed], wanted: Sequence[Sequence[int] | None]
) -> list[torch.Tensor | None]:
    """The wanted rows of every busy row, scored in one ``logits_from_hidden`` call and split back per row."""
    picks = [(b, t) for b, feed in enumerate(feeds) if feed for t in wanted[b]]
    if not picks:  # every row's logits are read later, from the forward's last hidden states
        return [None if not feed else last_hidden.new_zeros(0, 0) for feed in feeds]
    rows = torch.tensor([b for b, _ in picks], device=last_hidden.device)
    cols = torch.tensor([t for _, t in picks], device=last_hidden.device)
    scored = runner.logits_from_hidden(last_hidden[rows, cols]).float()
    logits: list[torch.Tensor | None] = []
    start = 0
    for b, feed in enumerate(feeds):
        if not feed:
            logits.append(None)
            continue
        count = len(wanted[b])
        logits.append(scored[start : start + count])
        start += count
    return logits


class _first_rows:
    """``runner.first_rows(n)`` where the runner has it and ``n`` is short of its batch; else the whole batch."""

    def __init__(self, runner, n: int):
        if n > runner.batch_size:
            raise ValueError(f"{n} rows fed but the runner's batch holds {runner.batch_size}")
        self.inner = runner.first_rows(n) if n < runner.batch_size and hasattr(runner, "first_rows") else None
        if self.inner is None and n < runner.batch_size:
            raise UserError(
                f"{type(runner).__name__} cannot step part of its batch; serve one request at a time "
                "(batch_size=1) or use the native runner"
            )

    def __enter__(self) -> None:
        if self.inner is not None:
            self.inner.__enter__()

    def __exit__(self, *exc) -> None:
        if self.inner is not None:
            self.inner.__exit__(*exc)


@dataclass
class Prefill:
    """Each new row's last-prompt-token logits (float32 [V]; None where not asked), captured layers
    {layer: [len_b, H]} and, where asked, final-normed hidden states [len_b, H]."""

    logits: list[torch.Tensor | None]
    hidden: list[dict[int, torch.Tensor]]
    forwards: int = 0  # runner forwards it took
    last_hidden: list[torch.Tensor | None] = field(default_factory=list)


def prefill_rows(
    runner,
    rows: Sequence[int],
    prompts: Sequence[Sequence[int]],
    *,
    logits: bool = True,
    capture_layers: Sequence[int] = (),
    return_last_hidden: bool = False,
) -> Prefill:
    """Write each prompt into its row's cache, emptied first; the other rows keep theirs. With spare rows (a runner
    of at least ``batch_size + len(rows)`` rows) the prompts run together in a block of spare rows and are copied
    into place; otherwise each runs in its own row, alone. An empty prompt leaves its row empty."""
    results = Prefill([None] * len(rows), [{} for _ in rows], last_hidden=[None] * len(rows))
    last_hidden = return_last_hidden and logits
    todo = [k for k, prompt in enumerate(prompts) if len(prompt)]
    if len(rows) and hasattr(runner, "row_block"):
        _empty(runner, [rows[k] for k in range(len(rows)) if k not in todo])
    if not todo:
        return results
    size = runner.batch_size
    if not hasattr(runner, "row_block"):  # one row, no row views: the whole (one-row) batch starts again
        if size != 1 or len(todo) != 1:
            raise UserError(f"{type(runner).__name__} prefills one request at a time; serve with batch_size=1")
        runner.reset(1)
        _prefill_block(runner, [prompts[todo[0]]], logits, capture_layers, results, todo, last_hidden)
        results.forwards = 1
        return results
    if size + len(todo) <= runner.max_batch_size:
        with runner.row_block(size, size + len(todo)):
            _prefill_block(runner, [prompts[k] for k in todo], logits, capture_layers, results, todo, last_hidden)
        runner.copy_rows(range(size, size + len(todo)), [rows[k] for k in todo], [len(prompts[k]) for k in todo])
        results.forwards = 1
        return results
    for k in todo:
        with runner.row_block(rows[k], rows[k] + 1):
            _prefill_block(runner, [prompts[k]], logits, capture_layers, results, [k], last_hidden)
        runner.copy_rows([rows[k]], [rows[k]], [len(prompts[k])])
    results.forwards = len(todo)
    return results


def _prefill_block(
    runner,
    prompts: Sequence[Sequence[int]],
    logits: bool,
    capture_layers: Sequence[int],
    results: Prefill,
    slots: Sequence[int],
    last_hidden: bool = False,
) -> None:
    """One forward over ``prompts`` (rows 0.. of the runner's current view), results written at ``slots``."""
    # no logits (a draft LM's prefill): no row is scored, the lm_head does not run
    wanted = [[len(p) - 1] if logits else [] for p in prompts]
    out = forward_rows(runner, prompts, wanted, capture_layers=capture_layers, return_last_hidden=last_hidden)
    for i, k in enumerate(slots):
        results.logits[k] = out.logits[i][0] if logits else None
        results.hidden[k] = {layer: h[i, : len(prompts[i])] for layer, h in out.forward.hidden.items()}
        if last_hidden:
            results.last_hidden[k] = out.forward.last_hidden[i, : len(prompts[i])]


def _empty(runner, rows: Sequence[int]) -> None:
    """Rows ``rows`` of the batch hold nothing."""
    if rows:
        lens = runner.cache_lens.clone()
        lens[torch.as_tensor(list(rows), dtype=torch.long, device=runner.device)] = 0
        runner.truncate(lens)
