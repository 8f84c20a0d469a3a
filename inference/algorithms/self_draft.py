"""Self-Draft (Gao et al., AAAI 2025): multi-branch self-drafting plus n-gram caches, no draft model.

Spec: docs/algorithms/self_draft.md. Every step is ONE target forward over

* the **head**: the tokens to commit, causal (the prompt at prefill, afterwards the last emitted token x_last);
  its last token is the **root** of everything below;
* the **grid**: N draft branches ("columns"). A column is a chain hanging off the root: its padding tokens,
  then its L-2 draft levels. Chain token k sits at position root+1+k and sees the committed text, the root
  and its own earlier chain tokens, nothing of other columns (§4). Once the grid is complete (warm-up,
  §3), each forward makes every column drop its oldest token and append the target's argmax at its last
  token (Jacobi-style, §5);
* the **candidates**: grams from the context cache (keyed by the root token) and the corpus cache, merged
  into a prefix trie hanging off the root; a trie node sees the root and its ancestors (§4, §8).

The root's and the nodes' logits are then verified by walking the forest from the root with the
deterministic-candidate rule (``verify.multi_candidate`` at each node, i.e. ``verify.tree_walk``'s rule):
exact for greedy and for sampling. The argmax at every grid token feeds the grid update and the context cache
(§7). The context cache lives as long as the algorithm instance (so it carries over between prompts) and is
trimmed every ``flush_interval`` prompts.

On the engine loop (:class:`SelfDraftSteps`; ``generate`` is a one-row run), each request is a row with its own
grid, text and grid vocabulary (:class:`DraftRow`); the grid and the candidate trie are one draft tree below the
row's root, scored in the step's one target forward with every other row's, and the first step reads the prompt
as the head (``Strategy.reads_prompt``), so a row's forwards are those of the request run alone. The context cache
is shared by requests, but a row never reads its neighbours' grams while they run: it reads a copy of the shared
cache taken at its admission plus its own grams (``ngram_cache.LoggedContextCache``), and when it ends its grams
are inserted into the shared cache in order (then the periodic trim). So a request's drafts, and so its counters,
are those of its run alone from the cache it was admitted with, whoever runs beside it; run one at a time, each
request reads everything the previous ones left, as before. The tokens never depend on the cache: greedy they are
the target's argmax, seeded each is one draw from the target's row with the row's generator. The cost: the step
that admits a request is as wide as its prompt plus its tree for every running row.

Under a width policy (``max_step_tokens``, ``width_policy=cost``; ``inference.engine.widths``) a row whose tree has
more nodes than its width allows proposes the first nodes of its candidate trie only, the grid sitting the step out
(``squeezed``); at width 1 it proposes nothing and the step is an AR step for it: the root's token sampled from
the target's row as AR samples it (``multi_candidate`` with no candidate is one draw from the row), so its tokens
are batched AR's. A squeezed row's drafts depend on the load, so its seeded tokens follow the target's law but are
not those of its run alone (greedy ones still are).

Differences from the original code, all lossless (they change speed, never the output):

* a fully matched candidate also emits the bonus token (the original stops at G tokens, §6);
* every grid column is a chain rooted at x_last, exactly like a candidate, so the walk also accepts tokens from
  the columns (their logits are computed anyway);
* candidates are verified from the prefill on, and the context cache is filled during the warm-up too; the
  prompt's own grams are indexed before the prefill;
* candidates sharing a prefix share trie nodes (same tokens at the same positions after the same ancestors
  give the same logits, so the emitted tokens are unchanged).

``compat_original_cap=True`` restores the original's counting for comparison with the paper's DE: no bonus
after a fully matched candidate, only cache candidates verified, and neither candidates nor cache updates
before the grid is complete.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from core.assets import tokenizer_fingerprint
from inference.algorithms.base import Algorithm
from inference.algorithms.options import SelfDraftOptions, with_fields
from inference.engine.rows import tree_feed
from inference.engine.state import RowState
from inference.engine.strategy import Proposal, Strategy
from inference.ngram_cache import ContextCache, CorpusCache, LoggedContextCache
from inference.row_logits import LogitsFromHidden, RowLogits, lazy_rows_on
from inference.sampling import SamplingParams
from inference.tree import DraftTree
from inference.verify import multi_candidate

PAD_SEED = 10  # the original reseeds its padding RNG with 10 at every generate call (§3)
CORPUS_GRAM_LEN = 4  # corpus grams are 4 tokens whatever G is (§9)


# ----------------------------------------------------------------------------------------------------------
# The branch grid


@dataclass
class Column:
    """One draft branch: ``tokens`` = its ``pad_len`` padding tokens followed by its draft levels."""

    tokens: list[int]
    pad_len: int

    @property
    def levels(self) -> int:
        return len(self.tokens) - self.pad_len


class BranchGrid:
    """The N columns of draft branches, through warm-up (growing) and steady state (sliding), §3, §5."""

    def __init__(self, columns: list[Column], branch_len: int):
        self.columns = columns
        self.branch_len = branch_len

    @classmethod
    def initial(
        cls, prompt: Sequence[int], branch_len: int, branch_num: int, max_pad_len: int, rng: random.Random
    ) -> BranchGrid:
        """N + L - 3 padding-only columns copied at random from the prompt. The first L-2 columns, which
        become column 0 one after the other during warm-up, get a single padding token."""
        columns = []
        for j in range(branch_num + branch_len - 3):
            pad_len = 1 if j < branch_len - 2 else rng.randint(1, max_pad_len)
            columns.append(Column([rng.choice(prompt) for _ in range(pad_len)], pad_len))
        return cls(columns, branch_len)

    @property
    def full(self) -> bool:
        """True once every column holds its L-2 draft levels (steady state)."""
        return self.columns[0].levels >= self.branch_len - 2

    def advance(self, tail_preds: Sequence[int]) -> None:
        """Grow every column by the argmax at its last token, then slide (steady state) or, during warm-up,
        drop the unpadded column 0 and unpad the next column, which becomes the new column 0."""
        steady = self.full
        columns = [Column(c.tokens + [int(p)], c.pad_len) for c, p in zip(self.columns, tail_preds)]
        if steady:
            for column in columns:  # padding is a FIFO of fixed length; column 0 loses its first level
                column.tokens = column.tokens[1:]
        else:
            if columns[0].pad_len == 0:
                columns = columns[1:]
            first = columns[0]
            columns[0] = Column(first.tokens[first.pad_len :], 0)
        self.columns = columns


# ----------------------------------------------------------------------------------------------------------
# One step's token layout: grid columns and the candidate trie as one forest under the root


@dataclass
class StepLayout:
    """The nodes of one forward after the head. ``parents[i] = -1``: child of the root; ``depths[i]``: 1 for a
    child of the root; ``column_nodes[j][k]``: node of column j's chain token k; nodes ``[0, num_grid)`` are
    grid tokens, the rest candidate-trie nodes."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    column_nodes: list[list[int]]
    num_grid: int

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def tree(self) -> DraftTree:
        """The nodes as a draft tree below the root (the engine scores it under its ancestor mask)."""
        return DraftTree(self.tokens, self.parents, self.depths)


def layout_step(columns: Sequence[Column], candidates: Sequence[Sequence[int]]) -> StepLayout:
    """Grid tokens in the original's order (every column's padding, column by column, then the draft levels
    level by level across columns), then the candidates merged into a prefix trie (§4)."""
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []

    def add(token: int, parent: int) -> int:
        tokens.append(int(token))
        parents.append(parent)
        depths.append(1 if parent < 0 else depths[parent] + 1)
        return len(tokens) - 1

    column_nodes = [[-1] * len(c.tokens) for c in columns]

    def add_chain_token(j: int, k: int) -> None:
        column_nodes[j][k] = add(columns[j].tokens[k], column_nodes[j][k - 1] if k else -1)

    for j, column in enumerate(columns):
        for k in range(column.pad_len):
            add_chain_token(j, k)
    for level in range(columns[0].levels if columns else 0):
        for j, column in enumerate(columns):
            add_chain_token(j, column.pad_len + level)
    num_grid = len(tokens)

    trie: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for gram in candidates:
        parent = -1
        for token in gram:
            node = trie.get((parent, int(token)))
            if node is None:
                node = trie[(parent, int(token))] = add(token, parent)
            parent = node
    return StepLayout(tokens, parents, depths, column_nodes, num_grid)


def squeezed(candidates: Sequence[Sequence[int]], nodes: int) -> StepLayout:
    """A step of at most ``nodes`` nodes: the first ``nodes`` of the candidate trie, the grid left out. A trie node
    comes after its parent, so any first nodes are a tree; the grid is all or nothing (each column's last token
    feeds its Jacobi update), and under a cap the candidates, the context's and the corpus' grams, are the cheaper
    bet. The grid sits the step out unchanged; the context cache still indexes the emitted text. Lossless like any
    tree: the walk verifies whatever is proposed."""
    full = layout_step([], candidates)
    return StepLayout(full.tokens[:nodes], full.parents[:nodes], full.depths[:nodes], [], 0)


def attention_inputs(layout: StepLayout, head_len: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [T] and the new-token mask [T, T] (True = may attend; the KV cache is visible to all) for
    the head (``head_len`` tokens from position ``start``, causal) followed by the layout's nodes: a node at
    depth d sits at root position + d and sees the whole head, its ancestors and itself (what the engine's
    forward feeds a row: ``inference.engine.rows.tree_feed``)."""
    offsets, mask = tree_feed(head_len, layout.tree)
    return start + offsets, mask


# ----------------------------------------------------------------------------------------------------------


class NodeLogits(RowLogits):
    """One step's logits by row (0 = root, i + 1 = node i; ``inference.row_logits``). On a GPU every row comes
    with the forward. On a CPU the rows are computed on demand (the root's always, it is always verified): the
    grid rows need only their argmax (grid update, context cache), which :meth:`grid_argmax`
    takes in one call over the full vocabulary or over a :class:`GridVocab`, and a candidate row is computed
    when the walk visits it. Which tokens the grid proposes changes speed only; every emitted token comes
    from full-vocabulary rows, computed by the runner's ``logits_from_hidden`` (its forward's own path).
    ``head_weight``: the lm_head's weight, for :class:`GridVocab`'s proposals."""

    def __init__(
        self,
        hidden: torch.Tensor | None,
        logits_from_hidden: LogitsFromHidden | None,
        *,
        known: torch.Tensor | None,
        head_weight: torch.Tensor,
    ):
        super().__init__(hidden, logits_from_hidden, known=known)
        self.head_weight = head_weight

    @classmethod
    def of(cls, rows: RowLogits, head_weight: torch.Tensor) -> NodeLogits:
        """The engine's rows of one step (``RowLogits``: read on demand, or computed with the forward)."""
        return cls(rows.hidden, rows.logits_from_hidden, known=rows.known, head_weight=head_weight)

    @torch.no_grad()
    def grid_argmax(self, num_grid: int, vocab: GridVocab | None) -> list[int]:
        """Argmax at the root (full) and at the ``num_grid`` grid rows (full, or over ``vocab``)."""
        root = [int(self[0].argmax())]
        if not num_grid:
            return root
        if self.known is not None and len(self.known) > num_grid:  # computed with the forward: nothing to save
            return root + self.known[1 : 1 + num_grid].argmax(dim=-1).tolist()
        hidden = self.hidden[1 : 1 + num_grid]
        if vocab is not None:
            return root + vocab.argmax(hidden, self.head_weight)
        logits = self.logits_from_hidden(hidden)
        self._rows.update({1 + i: row for i, row in enumerate(logits)})  # the walk may visit them
        return root + logits.argmax(dim=-1).tolist()


class GridVocab:
    """The tokens the grid's argmax looks at when ``grid_vocab=K``: ids below K (byte-level BPE ids follow
    merge order, so the lowest ids are the commonest tokens), plus every token of the prompt and of the text
    so far. On SmolLM2's greedy outputs (3 prompts x 96 tokens per bench) K = 8192 covers 95 % (HumanEval),
    85 % (MT-Bench) and 98 % (GSM-symbolic) of the tokens, at a sixth of the lm_head's cost per grid row."""

    def __init__(self, size: int):
        self.size = size
        self._extra: list[int] = []
        self._seen: set[int] = set()

    def reset(self, tokens: Sequence[int]) -> None:
        self._extra, self._seen = [], set()
        self.add(tokens)

    def add(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            if token >= self.size and token not in self._seen:
                self._seen.add(token)
                self._extra.append(token)

    def argmax(self, hidden: torch.Tensor, weight: torch.Tensor) -> list[int]:
        logits = torch.nn.functional.linear(hidden, weight[: self.size]).float()
        if self._extra:
            extra = torch.tensor(self._extra, device=weight.device)
            extra_logits = torch.nn.functional.linear(hidden, weight[extra]).float()
            best_extra, extra_index = extra_logits.max(dim=-1)
            best, index = logits.max(dim=-1)
            return torch.where(best_extra > best, extra[extra_index], index).tolist()
        return logits.argmax(dim=-1).tolist()


class SelfDraft(Algorithm):
    """Self-Draft; its options (:class:`SelfDraftOptions`) default to the paper's (§10).

    ``options.corpus``: a :class:`CorpusCache` or the path of one (``python -m data_prep.ngram_corpus``), checked
    against ``tokenizer`` when given; None = no corpus cache. ``grid_vocab=K`` takes the grid's argmax over the K
    lowest ids plus the text's tokens (:class:`GridVocab`; a CPU speed-up, lossless like every grid choice); 0 = the
    full vocabulary. ``context_cache=False`` switches the context cache off (ablation). ``verify_branches``: also
    accept tokens from the grid columns (lossless; off under ``compat_original_cap``).
    """

    name = "self_draft"
    drafter = "none"
    batchable = True
    squeezable = True  # a row under a width cap proposes fewer nodes (``squeezed``), none at width 1
    context = ("tokenizer",)

    def __init__(
        self,
        target,
        options: SelfDraftOptions | None = None,
        *,
        tokenizer=None,
        context_cache: bool = True,
        max_pad_len: int = 2,
        flush_interval: int = 2,
        keep_num: int = 2,
        max_seq_len: int | None = None,
        **fields,
    ):
        super().__init__(target, max_seq_len=max_seq_len)
        self.options = options = with_fields(SelfDraftOptions, options, fields)
        branch_len, branch_num, gram_len = options.branch_len, options.branch_num, options.gram_len
        ctx_candidates, corpus_candidates = options.ctx_candidates, options.corpus_candidates
        grid_vocab, compat_original_cap = options.grid_vocab, options.compat_original_cap
        checks = [
            (branch_len >= 3, f"branch_len (L) must be >= 3, got {branch_len}"),
            (branch_num >= 1, f"branch_num (N) must be >= 1, got {branch_num}"),
            (gram_len >= 2, f"gram_len (G) must be >= 2, got {gram_len}"),
            (max_pad_len >= 1, f"max_pad_len must be >= 1, got {max_pad_len}"),
            (
                ctx_candidates >= 0 and corpus_candidates >= 0,
                f"candidate counts must be >= 0, got ctx={ctx_candidates} corpus={corpus_candidates}",
            ),
            (grid_vocab >= 0, f"grid_vocab must be >= 0 (0 = the full vocabulary), got {grid_vocab}"),
            (
                flush_interval >= 0 and keep_num >= 1,
                f"need flush_interval >= 0 (0 = never) and keep_num >= 1, got {flush_interval}, {keep_num}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.branch_len, self.branch_num, self.max_pad_len = branch_len, branch_num, max_pad_len
        self.gram_len = min(gram_len, branch_len - 1)  # §7: G = min(context_gram_n, L - 1)
        self.ctx_candidates, self.corpus_candidates = ctx_candidates, corpus_candidates
        self.flush_interval, self.keep_num = flush_interval, keep_num
        self.compat = compat_original_cap
        self.verify_branches = options.verify_branches and not compat_original_cap
        self.context = ContextCache() if context_cache else None
        self.corpus = options.corpus
        if isinstance(self.corpus, (str, Path)):
            fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
            self.corpus = CorpusCache.load(self.corpus, tokenizer_fingerprint=fingerprint)
        vocab = getattr(target.config, "vocab_size", None)
        if self.corpus is not None and vocab is not None and self.corpus.max_token_id >= vocab:
            raise ValueError(
                f"n-gram corpus holds token id {self.corpus.max_token_id} >= the target's vocab_size "
                f"{vocab}: it was built for another tokenizer"
            )
        self.grid_vocab = GridVocab(grid_vocab) if 0 < grid_vocab < (vocab or grid_vocab + 1) else None
        self._conversations = 0

    def lookahead(self) -> int:
        """Root + the largest grid (warm-up included) + every candidate token, an upper bound."""
        grid = (self.branch_num + self.branch_len - 3) * (self.max_pad_len + self.branch_len - 2)
        candidates = self.ctx_candidates * self.gram_len + self.corpus_candidates * CORPUS_GRAM_LEN
        return 1 + grid + candidates

    def reset_caches(self) -> None:
        """Forget the context cache (it otherwise carries over between prompts)."""
        if self.context is not None:
            self.context.clear()
        self._conversations = 0

    def strategy(self) -> SelfDraftSteps:
        return SelfDraftSteps(self)

    def new_row(self, prompt: Sequence[int]) -> DraftRow:
        """A request's own state: its grid (warm-up from the start), its text, its view of the context cache (with
        the prompt's grams indexed) and its grid vocabulary."""
        prompt = list(prompt)
        grid = BranchGrid.initial(prompt, self.branch_len, self.branch_num, self.max_pad_len, random.Random(PAD_SEED))
        vocab = None
        if self.grid_vocab is not None:
            vocab = GridVocab(self.grid_vocab.size)
            vocab.reset(prompt)
        context = LoggedContextCache(self.context) if self.context is not None else None
        indexed = self._index_prompt(prompt, context) if context is not None and not self.compat else 0
        return DraftRow(grid, prompt, indexed, context, vocab)

    def end_row(self, row: DraftRow | None) -> None:
        """A request ended (done, failed or cancelled): its grams go into the shared context cache, which is trimmed
        every ``flush_interval`` requests."""
        self._conversations += 1
        if self.context is None:
            return
        if row is not None and row.context is not None:
            row.context.replay_into(self.context)
        if self.flush_interval and self._conversations % self.flush_interval == 0:
            self.context.trim(self.keep_num)

    def propose(self, row: DraftRow, width: int = 0) -> Proposal:
        """The row's grid and candidate trie as one draft tree below its root (``text[-1]``). ``width``: the target
        rows the engine lets the row's step score (0 = no cap): a tree of more nodes than ``width - 1`` is squeezed
        (:func:`squeezed`); width 1 proposes nothing, an AR step."""
        live = not self.compat or row.grid.full  # the original has no candidates before steady state
        candidates = self._candidates(row.text, row.context) if live else []
        layout = layout_step(row.grid.columns, candidates)
        if width and len(layout) > width - 1:
            layout = squeezed(candidates, width - 1)
        return Proposal(tokens=list(layout.tokens), tree=layout.tree, extra=(layout, live))

    def verify(
        self,
        row: DraftRow,
        proposal: Proposal,
        rows: RowLogits,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> TrieWalk:
        """The grid's argmax (and the context cache's update from it), then the walk from the root."""
        layout, live = proposal.extra
        logits = NodeLogits.of(rows, self.target.lm_head.weight)  # row 0 = root, row i + 1 = node i
        preds = logits.grid_argmax(layout.num_grid, row.vocab)  # root and grid: cache + grid update
        if row.context is not None and live:
            row.indexed = self._update_context(row.text, row.indexed, row.grid, layout, preds, row.context)
        first = 0 if self.verify_branches else layout.num_grid
        path, bonus, children = self._walk(layout, logits, first, sampling, generator)
        emitted = [layout.tokens[n] for n in path] + [bonus]
        kept = path
        if self.compat and path and not children[path[-1] + 1]:
            emitted, kept = emitted[:-1], path[:-1]  # original: stop at G tokens, no bonus
        return TrieWalk(kept, emitted, len(path), max(layout.depths[first:], default=0), preds)

    def advance(self, row: DraftRow, proposal: Proposal, walk: TrieWalk) -> None:
        """After a step: the emitted tokens join the text, and the grid moves on by the argmax at each column's
        end."""
        layout, _ = proposal.extra
        row.text.extend(walk.tokens)
        if row.vocab is not None:
            row.vocab.add(walk.tokens)
        if layout.column_nodes:  # a squeezed step left the grid out: it waits as it is
            row.grid.advance([walk.preds[1 + nodes[-1]] for nodes in layout.column_nodes])

    def _walk(
        self,
        layout: StepLayout,
        logits: NodeLogits,
        first: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> tuple[list[int], int, list[list[int]]]:
        """Accepted node path, the correction/bonus token, and the walkable children per row (row 0 = root,
        row i + 1 = node i). Nodes before ``first`` are not offered at the root. Rows are warped lazily: only
        the visited ones (warping all T x V rows would cost more than the forward on a CPU)."""
        children: list[list[int]] = [[] for _ in range(len(layout) + 1)]
        for node, parent in enumerate(layout.parents):
            if parent >= 0 or node >= first:
                children[parent + 1].append(node)
        path: list[int] = []
        row = 0
        while True:
            kids = children[row]
            match = multi_candidate([layout.tokens[k] for k in kids], sampling.warp(logits[row]), generator)
            if match.candidate_index is None:
                return path, match.token, children
            node = kids[match.candidate_index]
            path.append(node)
            row = node + 1

    # -- caches ----------------------------------------------------------------------------------------------

    def _candidates(self, text: list[int], context: ContextCache | None = None) -> list[tuple[int, ...]]:
        """Context grams keyed by the root token (most recent ones if capped), then corpus grams (§8).
        ``context``: a request's view of the context cache (default: the shared one)."""
        context = self.context if context is None else context
        chosen = []
        if context is not None and self.ctx_candidates:
            chosen = context.retrieve(text[-1])[-self.ctx_candidates :]
        if self.corpus is not None and self.corpus_candidates:
            full = len(chosen) >= self.ctx_candidates
            slots = (
                self.corpus_candidates - 1 if full else min(self.corpus_candidates, self.ctx_candidates - len(chosen))
            )
            chosen = chosen + self.corpus.lookup(text[-CORPUS_GRAM_LEN:], slots, exclude=chosen)
        return chosen

    def _index_prompt(self, text: list[int], context: ContextCache) -> int:
        """Insert the prompt's complete grams before the prefill; returns the first position left to index."""
        g = self.gram_len
        for i in range(len(text) - g):
            context.insert(text[i], text[i + 1 : i + 1 + g])
        return max(len(text) - g, 0)

    def _update_context(
        self,
        text: list[int],
        indexed: int,
        grid: BranchGrid,
        layout: StepLayout,
        preds: list[int],
        context: ContextCache | None = None,
    ) -> int:
        """§7: grams from every column (G-1 chain tokens + the fresh argmax after them; the column
        attached to the root also yields the gram after the root), then the committed text since position
        ``indexed`` (padded with the root-attached column when short), then the freshly decoded gram, into
        ``context`` (default: the shared cache). Returns the new ``indexed``."""
        g, cache, t0 = self.gram_len, self.context if context is None else context, preds[0]
        tail: list[int] = []  # the root-attached column's continuation (the text's noisy future)
        order = list(range(1, len(grid.columns))) + [0]  # the original inserts column 0 last
        order = order if layout.column_nodes else []  # a squeezed step scored no grid
        for j in order:
            column, nodes = grid.columns[j], layout.column_nodes[j]
            chain, chain_preds = column.tokens, [preds[1 + n] for n in nodes]
            if column.pad_len == 0:
                tail = chain + chain_preds[-1:]
                chain, chain_preds = [text[-1]] + chain, [t0] + chain_preds
            for start in range(len(chain) - g + 1):
                cache.insert(chain[start], chain[start + 1 : start + g] + [chain_preds[start + g - 1]])
        for i in range(indexed, len(text)):
            gram = text[i + 1 : i + 1 + g]
            gram = gram + tail[: g - len(gram)]
            if len(gram) == g:
                cache.insert(text[i], gram)
        if len(text) >= g:
            cache.insert(text[-g], text[-g + 1 :] + [t0])
        return len(text)


# ----------------------------------------------------------------------------------------------------------
# On the engine loop


@dataclass
class DraftRow:
    """A request's Self-Draft state between steps: its grid, its text (``text[-1]`` is the root of the next step),
    the first text position the context cache has not indexed yet, its view of the context cache (None: no context
    cache) and its grid vocabulary (None: the full vocabulary)."""

    grid: BranchGrid
    text: list[int]
    indexed: int
    context: LoggedContextCache | None
    vocab: GridVocab | None


@dataclass
class TrieWalk:
    """One step's verification: the nodes the target keeps (``path``), the emitted tokens, the nodes the walk
    accepted (``walked``: the compat mode keeps one fewer after a full match), the deepest walkable node's depth
    (the round's chain length) and the argmax at the root and at every grid node."""

    path: list[int]
    tokens: list[int]
    walked: int
    drafted: int
    preds: list[int]

    @property
    def num_accepted(self) -> int:
        return len(self.path)


class SelfDraftSteps(Strategy):
    """Self-Draft as a strategy of the engine loop: each running row's grid and candidate trie are one draft tree
    below its root, scored in the step's one target forward; the walk, the grid's update and the context cache's
    update are the row's own. A new row's first step reads its prompt (``reads_prompt``): the prefill verifies
    candidates and starts the grid, as the algorithm always did."""

    name = "self_draft"
    reads_prompt = True

    def __init__(self, algorithm: SelfDraft):
        self.algorithm = algorithm
        self.lazy_tree_rows = lazy_rows_on(algorithm.target)  # the grid needs only its argmax, the walk ~τ rows

    def lookahead(self) -> int:
        return self.algorithm.lookahead()

    def admit(self, states: Sequence[RowState], hidden: Sequence[dict[int, torch.Tensor]]) -> None:
        for state in states:
            state.draft = self.algorithm.new_row(state.request.prompt)

    def propose(self, states: Sequence[RowState]) -> list[Proposal]:
        return [self.algorithm.propose(state.draft, state.width) for state in states]

    def verify(self, state: RowState, proposal: Proposal, logits: RowLogits) -> TrieWalk:
        return self.algorithm.verify(state.draft, proposal, logits, state.sampling, state.generator)

    def count_round(self, state: RowState, proposal: Proposal, result: TrieWalk) -> None:
        """A round per step with walkable nodes: the deepest one's depth drafted, the walked nodes accepted."""
        if result.drafted:
            state.stats.record_round(result.drafted, result.walked)

    def verified(self, state: RowState, proposal: Proposal, result: TrieWalk, forward, row: int) -> None:
        self.algorithm.advance(state.draft, proposal, result)

    def release(self, state: RowState) -> None:
        self.algorithm.end_row(state.draft)
