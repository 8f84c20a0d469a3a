"""SSD's draft side (docs/algorithms/ssd.md §3): serves speculations from the cache or a fallback, then drafts ahead.

The algorithm (target side) talks to it only through method calls carrying packed int64 payloads, so the same
object runs in this process (``sequential`` / ``cuda_streams`` executors) or in a child process (``multiprocess``).
Every random draw here comes from the draft side's own seeded generator.

Per round, for a batch of ``b`` sequences with lookahead ``K`` and budget ``B`` branches per sequence:

* ``serve(request)``: commit the verified outcome (roll the drafter KV back to the committed length), look each key
  ``(row, k, bonus)`` up in the cache; hits return the cached tokens + the raw logits they were drawn from; misses
  get the fallback (JIT: the drafter drafts K tokens now, SAGUARO sampling; fast: n-gram / random tokens with their
  real proposal kind). Reply packed.
* ``speculate(request)`` (overlapped with the target's verification): GLUE decode ``[bonus, s_1..s_K]``, FORK the
  top-``F_j`` next-token guesses at each acceptance length ``j`` (excluding the drafted ``s_{j+1}``), TREE decode
  all ``B`` branches K steps in parallel (one drafter forward per step, tree attention mask), POPULATE the cache.

Fork vocabulary (``fork_vocab``). A vocabulary-limited drafter (``draft_vocab=N``: it proposes only ids < N) would
also limit the fork guesses, so a bonus token with a larger id could never be a cache hit. ``full`` (the default)
scores the K+1 glue rows with the drafter's whole lm_head for the forks only (the drafted tokens still come from
the limited head); ``draft`` forks on the limited head. Which keys are cached never depends on the branch tokens,
so either choice is lossless (§6); only the hit rate differs.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from core import assets
from inference.ngram_cache import ContextCache
from inference.runner_loading import load_runner, with_logit_vocab
from inference.saguaro import NEURAL, POINT, UNIFORM, saguaro_sample
from inference.sampling import SamplingParams
from inference.ssd_cache import NO_KEY, SpecCache

FALLBACKS = {"jit": 0, "fast": 1}
FORK_VOCABS = ("full", "draft")  # the fork guesses come from the drafter's whole lm_head | its limited one
FAST_KINDS = {"ngram": 0, "random": 1}
HIT, JIT, FAST, IDLE = 0, 1, 2, 3  # where a row's speculation came from (IDLE: finished row, tokens unused)


def _f2i(x: float) -> int:
    """Bit-cast a float64 into an int64 (so floats ride in the fused int64 payload exactly)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _i2f(x: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(x)))[0]


# ------------------------------------------------------------------------------------------------------------
# Wire format: one fused int64 tensor per message (§8), floats bit-cast.


@dataclass
class ServeRequest:
    keys: Tensor  # [b, 2] (k accepted last round | NO_KEY, bonus token)
    lengths: Tensor  # [b] committed tokens per row (the drafter KV is rolled back to these)
    active: Tensor  # [b] bool: rows still generating
    jit_tops: Tensor  # [b, K] SAGUARO set sizes for JIT-drafted tokens
    temperature: float
    top_k: int
    top_p: float
    c: float
    fallback: int  # FALLBACKS value
    fast_kind: int  # FAST_KINDS value

    def pack(self) -> Tensor:
        b, k = self.jit_tops.shape
        header = torch.tensor(
            [b, k, _f2i(self.temperature), self.top_k, _f2i(self.top_p), _f2i(self.c), self.fallback, self.fast_kind],
            dtype=torch.long,
        )
        return torch.cat(
            [
                header,
                self.keys.long().reshape(-1).cpu(),
                self.lengths.long().cpu(),
                self.active.long().cpu(),
                self.jit_tops.long().reshape(-1).cpu(),
            ]
        )

    @classmethod
    def unpack(cls, payload: Tensor) -> ServeRequest:
        h = payload[:8].tolist()
        b, k = h[0], h[1]
        body = payload[8:]
        keys, body = body[: 2 * b].view(b, 2), body[2 * b :]
        lengths, active, body = body[:b], body[b : 2 * b].bool(), body[2 * b :]
        return cls(
            keys, lengths, active, body[: b * k].view(b, k), _i2f(h[2]), h[3], _i2f(h[4]), _i2f(h[5]), h[6], h[7]
        )


@dataclass
class SpeculateRequest:
    fanout: Tensor  # [b, K+1] forks per acceptance length, summing to B in every row
    tree_tops: Tensor  # [b, K] SAGUARO set sizes for the tree-decoded tokens
    temperature: float
    top_k: int
    top_p: float
    c: float

    def pack(self) -> Tensor:
        b, k1 = self.fanout.shape
        header = torch.tensor(
            [b, k1 - 1, _f2i(self.temperature), self.top_k, _f2i(self.top_p), _f2i(self.c)], dtype=torch.long
        )
        return torch.cat([header, self.fanout.long().reshape(-1).cpu(), self.tree_tops.long().reshape(-1).cpu()])

    @classmethod
    def unpack(cls, payload: Tensor) -> SpeculateRequest:
        h = payload[:6].tolist()
        b, k = h[0], h[1]
        body = payload[6:]
        return cls(
            body[: b * (k + 1)].view(b, k + 1), body[b * (k + 1) :].view(b, k), _i2f(h[2]), h[3], _i2f(h[4]), _i2f(h[5])
        )


@dataclass
class Speculation:
    """The reply to ``serve``: what the target verifies this round."""

    source: Tensor  # [b] HIT | JIT | FAST | IDLE
    tokens: Tensor  # [b, K]
    kinds: Tensor  # [b, K] NEURAL | POINT | UNIFORM (the proposal each token was drawn from)
    tops: Tensor  # [b, K] SAGUARO set sizes the sampler used (NEURAL tokens)
    draft_forwards: int
    logits: Tensor  # [b, K, V] raw draft logits of NEURAL tokens (zeros elsewhere)

    def pack(self) -> tuple[Tensor, Tensor]:
        b, k = self.tokens.shape
        ints = torch.cat(
            [
                torch.tensor([b, k, self.draft_forwards]),
                self.source.long().cpu(),
                self.tokens.long().reshape(-1).cpu(),
                self.kinds.long().reshape(-1).cpu(),
                self.tops.long().reshape(-1).cpu(),
            ]
        )
        return ints, self.logits

    @classmethod
    def unpack(cls, ints: Tensor, logits: Tensor) -> Speculation:
        b, k, forwards = ints[:3].tolist()
        body = ints[3:]
        source, body = body[:b], body[b:]
        tokens, kinds, tops = (body[i * b * k : (i + 1) * b * k].view(b, k) for i in range(3))
        return cls(source, tokens, kinds, tops, forwards, logits)


# ------------------------------------------------------------------------------------------------------------


def tree_step_mask(base: Tensor, cached: int, fork_len: Tensor, k_max: int, step: int) -> Tensor:
    """Attention mask [b, B, cached + B] (runner convention) of tree-decode step ``step`` (1..K).

    Branch ``u`` of row ``b`` forks after glue token ``fork_len[b, u]`` = j. It sees the committed prefix
    (slots < base[b]), glue tokens 0..j (slots base..base+j), its own tokens of earlier steps (slot
    base + K+1 + (s−1)·B + u for s < step) and itself; nothing of the other branches."""
    b, width = fork_len.shape
    col = torch.arange(cached + width, device=fork_len.device).view(1, 1, -1)
    base = base.view(b, 1, 1)
    j = fork_len.unsqueeze(-1)
    u = torch.arange(width, device=fork_len.device).view(1, -1, 1)
    glue_or_prefix = col <= base + j
    rel = col - base - (k_max + 1)
    own_tree = (rel >= 0) & (rel < (step - 1) * width) & (rel.remainder(width) == u) & (col < cached)
    own_new = col == cached + u
    return (glue_or_prefix & (col < cached)) | own_tree | own_new


def given_runner(runner: Any) -> Any:
    return runner


def build_draft_runner(
    source: Any, *, device: str | torch.device, max_batch_size: int, max_seq_len: int, logit_vocab: int | None = None
) -> Any:
    """A drafter runner from a runner, a callable returning a runner / HF model, or a draft LM directory path
    (``logit_vocab``: see ``inference.runner_loading.with_logit_vocab``; a runner given already carries its own)."""
    if isinstance(source, str):
        model = assets.load_model(source, device=str(device))
        runner = load_runner(model, device=device, max_batch_size=max_batch_size, max_seq_len=max_seq_len)
        return with_logit_vocab(runner, logit_vocab)
    built = source() if callable(source) and not hasattr(source, "forward") else source
    if hasattr(built, "truncate"):  # already a runner
        return built
    return load_runner(built, device=device, max_batch_size=max_batch_size, max_seq_len=max_seq_len)


class SSDDraftSide:
    """Owns the drafter runner, the speculation cache, the n-gram tables and the draft-side generator."""

    def __init__(
        self,
        source: Any,
        *,
        lookahead: int,
        budget: int,
        seed: int = 0,
        device: str = "cpu",
        max_batch_size: int = 1,
        max_seq_len: int = 2048,
        threads: int | None = None,
        logit_vocab: int | None = None,
        fork_vocab: str = "full",
    ):
        if fork_vocab not in FORK_VOCABS:
            raise ValueError(f"ssd fork_vocab must be one of {', '.join(FORK_VOCABS)}, got {fork_vocab!r}")
        if threads:
            torch.set_num_threads(threads)
        self.runner = build_draft_runner(
            source, device=device, max_batch_size=max_batch_size, max_seq_len=max_seq_len, logit_vocab=logit_vocab
        )
        self.device = self.runner.device
        self.k = lookahead
        self.budget = budget
        # full-head forks only mean something when the drafter's own logits are vocabulary-limited
        self.full_forks = fork_vocab == "full" and getattr(self.runner, "logit_vocab", None) is not None
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.cache = SpecCache()
        self.history: list[list[int]] = []
        self.ngrams: list[ContextCache] = []
        self._indexed: list[int] = []
        self.spec: Tensor | None = None  # the speculation being verified [b, K]
        self.bonus: Tensor | None = None  # its leading (already decided) token [b]

    # -- prompts ------------------------------------------------------------------------------------------------

    def prefill(self, prompts: Sequence[Sequence[int]]) -> int:
        """Reset for a new batch and read the prompts (right-padded, then each row rolled back to its length)."""
        runner, b = self.runner, len(prompts)
        runner.reset(b)
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        ids = torch.tensor([list(p) + [0] * (width - len(p)) for p in prompts], dtype=torch.long)
        runner.forward(ids.to(self.device), only_last_logits=True)
        runner.truncate(torch.tensor(lengths, device=self.device))
        self.cache.clear()
        self.history = [list(map(int, p)) for p in prompts]
        self.ngrams = [ContextCache(per_key=1) for _ in prompts]
        self._indexed = [0] * b
        self.spec = self.bonus = None
        return 1

    # -- serve --------------------------------------------------------------------------------------------------

    def serve(self, payload: Tensor) -> tuple[Tensor, Tensor]:
        """Commit last round's outcome, then return this round's speculation (packed :class:`Speculation`)."""
        req = ServeRequest.unpack(payload)
        b, k_max = req.jit_tops.shape
        keys = req.keys.to(self.device)
        self._commit(req)
        self.runner.truncate(req.lengths.to(self.device))
        active = req.active.to(self.device)
        hit, index = self.cache.lookup(keys)
        hit &= active
        tokens, logits, tops = self._empty(b)
        if self.cache.keys is not None and bool(hit.any()):
            c_tokens, c_logits, c_tops = self.cache.fetch(index)
            tokens = torch.where(hit[:, None], c_tokens, tokens)
            logits = torch.where(hit[:, None, None], c_logits, logits)
            tops = torch.where(hit[:, None], c_tops, tops)
        kinds = torch.full((b, k_max), POINT, dtype=torch.long, device=self.device)
        kinds[hit] = NEURAL
        source = torch.full((b,), IDLE, dtype=torch.long, device=self.device)
        source[hit] = HIT
        miss = active & ~hit
        forwards = 0
        if bool(miss.any()):
            sampling = SamplingParams(req.temperature, req.top_k, req.top_p)
            if req.fallback == FALLBACKS["jit"]:
                j_tokens, j_logits = self._jit(keys[:, 1], req.jit_tops.to(self.device), req.c, sampling)
                forwards = k_max
                self.runner.truncate(req.lengths.to(self.device))
                tokens[miss], logits[miss], tops[miss] = (
                    j_tokens[miss],
                    j_logits[miss],
                    req.jit_tops.to(self.device)[miss],
                )
                kinds[miss] = NEURAL
                source[miss] = JIT
            else:
                for row in miss.nonzero().view(-1).tolist():
                    row_tokens, row_kinds = self._fast(row, int(keys[row, 1]), k_max, req.fast_kind)
                    tokens[row], kinds[row] = row_tokens, row_kinds
                source[miss] = FAST
        self.cache.clear()  # every branch was grown from the speculation just verified
        self.spec, self.bonus = tokens, keys[:, 1].clone()
        return Speculation(source, tokens, kinds, tops, forwards, logits).pack()

    def _empty(self, b: int) -> tuple[Tensor, Tensor, Tensor]:
        vocab = self.runner.config.vocab_size
        return (
            torch.zeros(b, self.k, dtype=torch.long, device=self.device),
            torch.zeros(b, self.k, vocab, dtype=torch.float32, device=self.device),
            torch.zeros(b, self.k, dtype=torch.long, device=self.device),
        )

    def _commit(self, req: ServeRequest) -> None:
        """Append the committed tokens (accepted draft prefix + bonus) to each active row's history."""
        for row, (k, bonus) in enumerate(req.keys.tolist()):
            if not bool(req.active[row]):
                continue
            if self.spec is not None and k != NO_KEY:
                self.history[row].extend(self.spec[row, :k].tolist())
            self.history[row].append(bonus)
            if len(self.history[row]) != int(req.lengths[row]) + 1:
                raise RuntimeError(
                    f"draft side out of sync on row {row}: history {len(self.history[row])} tokens, "
                    f"target committed {int(req.lengths[row])} (+1 bonus)"
                )

    def _jit(self, bonus: Tensor, tops: Tensor, c: float, sampling: SamplingParams) -> tuple[Tensor, Tensor]:
        """K tokens per row drafted now from the committed state + bonus (SAGUARO sampling)."""
        feed, tokens, logits = bonus[:, None], [], []
        for s in range(self.k):
            step_logits = self.runner.forward(feed, only_last_logits=True).logits[:, -1].float()
            token = saguaro_sample(step_logits, tops[:, s], c, sampling, self.generator)
            tokens.append(token)
            logits.append(step_logits)
            feed = token[:, None]
        return torch.stack(tokens, 1), torch.stack(logits, 1)

    def _fast(self, row: int, bonus: int, k_max: int, fast_kind: int) -> tuple[Tensor, Tensor]:
        """Near-free tokens: the most recent K-gram that followed ``bonus`` in this sequence (point masses), then
        uniformly random tokens (uniform proposal)."""
        gram: list[int] = []
        if fast_kind == FAST_KINDS["ngram"]:
            self._index_ngrams(row, k_max)
            grams = self.ngrams[row].retrieve(bonus)
            gram = list(grams[-1]) if grams else []
        vocab = self.runner.config.vocab_size
        rest = torch.randint(vocab, (k_max - len(gram),), generator=self.generator, device=self.device)
        tokens = torch.cat([torch.tensor(gram, dtype=torch.long, device=self.device), rest])
        kinds = torch.tensor([POINT] * len(gram) + [UNIFORM] * (k_max - len(gram)), device=self.device)
        return tokens, kinds

    def _index_ngrams(self, row: int, k_max: int) -> None:
        history = self.history[row]
        for i in range(self._indexed[row], len(history) - k_max):
            self.ngrams[row].insert(history[i], history[i + 1 : i + 1 + k_max])
        self._indexed[row] = max(self._indexed[row], len(history) - k_max)

    # -- speculate ----------------------------------------------------------------------------------------------

    def speculate(self, payload: Tensor) -> int:
        """Glue + fork + tree decode + populate for the speculation served last; returns drafter forwards."""
        req = SpeculateRequest.unpack(payload)
        if self.spec is None:
            raise RuntimeError("speculate() before serve(): nothing is being verified")
        runner, k_max = self.runner, self.k
        sampling = SamplingParams(req.temperature, req.top_k, req.top_p)
        fanout = req.fanout.to(self.device)
        tree_tops = req.tree_tops.to(self.device)
        b = fanout.shape[0]
        base = runner.cache_lens.clone()
        glue = runner.forward(torch.cat([self.bonus[:, None], self.spec], 1), return_last_hidden=self.full_forks)
        # d_0..d_K [b, K+1, V]: from the whole lm_head for full-vocabulary forks, else the drafter's own logits
        fork_len, fork_tok = self._fork(
            full_head_logits(runner, glue.last_hidden) if self.full_forks else glue.logits, fanout
        )
        width = fork_tok.shape[1]
        feed, steps_tok, steps_logits = fork_tok, [], []
        for step in range(1, k_max + 1):
            cached = int(runner.cache_lens.max())
            mask = tree_step_mask(base, cached, fork_len, k_max, step)
            logits = runner.forward(feed, positions=base[:, None] + fork_len + step, attention_mask=mask).logits.float()
            token = saguaro_sample(
                logits, tree_tops[:, step - 1, None].expand(b, width), req.c, sampling, self.generator
            )
            steps_tok.append(token)
            steps_logits.append(logits)
            feed = token
        keys = torch.stack([fork_len, fork_tok], -1)
        keys[fanout.sum(1) == 0] = NO_KEY
        self.cache.populate(
            keys, torch.stack(steps_tok, 2), torch.stack(steps_logits, 2), tree_tops[:, None, :].expand(b, width, k_max)
        )
        return 1 + k_max

    def _fork(self, glue: Tensor, fanout: Tensor) -> tuple[Tensor, Tensor]:
        """Branches (j, t) per row: the top-F_j tokens of d_j, excluding the drafted s_{j+1} for j < K. Rows whose
        fan-out sums to less than B pad with NO_KEY branches (static shapes)."""
        b, k1, _ = glue.shape
        scores = glue.clone()
        scores[:, :-1].scatter_(-1, self.spec[:, :, None], float("-inf"))
        top = scores.topk(int(fanout.max()), dim=-1).indices.tolist()  # [b, K+1, W]
        fork_len = torch.full((b, self.budget), NO_KEY, dtype=torch.long)
        fork_tok = torch.zeros((b, self.budget), dtype=torch.long)
        for row, fan in enumerate(fanout.tolist()):
            branches = [(j, t) for j in range(k1) for t in top[row][j][: fan[j]]][: self.budget]
            for u, (j, t) in enumerate(branches):
                fork_len[row, u], fork_tok[row, u] = j, t
        fork_len = fork_len.to(self.device)
        # Unused slots decode harmlessly after glue token 0 with token 0; their keys stay NO_KEY.
        return fork_len, fork_tok.to(self.device)


def full_head_logits(runner: Any, hidden: Tensor) -> Tensor:
    """fp32 logits over every id from the final-norm hidden states [..., H] a runner returned
    (``return_last_hidden``), through its whole lm_head, whatever its ``logit_vocab``."""
    flat = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    return runner.lm_head(flat).float().view(*hidden.shape[:-1], -1)


def draft_side_factory(source: Any, **kwargs: Any) -> Callable[[], SSDDraftSide]:
    """A (picklable when ``source`` is) factory for the executors: ``make_executor(name, factory)``."""

    return functools.partial(SSDDraftSide, source, **kwargs)
