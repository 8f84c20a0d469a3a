"""PEARL (docs/algorithms/specbranch.md §1): parallel speculative decoding with adaptive draft length.

Each round the target scores the pending segment U (plus the last committed token) while the draft side,
concurrently, drafts γ tokens d_1..d_γ after S+U as if U were accepted. At the join, U + [d_1] is verified
tokenwise (docs/algorithms/verify.md §2; §3 when greedy) against the target's rows p(·|S), .., p(·|S,U):

- all accepted: S += U + [d_1], U = d_2..d_γ ("post-verify": the next round checks them while drafting more);
- a rejection: S += accepted prefix + [residual sample], U = [] ("pre-verify": the next round's target call
  checks only the first new draft token, while the draft drafts the rest).

The first round is a pre-verify round whose target call is the prompt prefill, so the draft's prefill
overlaps it. No bonus token: the target's last row always judges a draft token. Draft length adapts on its own.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from inference.algorithms.base import GenerationStats, OutputBuffer
from inference.algorithms.overlapped import OverlappedDraftAlgorithm
from inference.draft_side import common_prefix
from inference.runner_contract import as_batch
from inference.sampling import SamplingParams
from inference.verify import tokenwise


def verify_without_bonus(tokens: list[int], draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                         generator: torch.Generator | None) -> tuple[int, int | None]:
    """Tokenwise verification of ``tokens`` [n] with one target row per token ([n, V], no bonus row):
    (accepted count, correction token or None when all were accepted)."""
    n, vocab = target_probs.shape
    # A point-mass placeholder bonus row: the verifier draws from it only when all n are accepted, and a point
    # mass is resolved without the generator, so it changes neither the law nor the random stream.
    placeholder = F.one_hot(torch.zeros(1, dtype=torch.long), vocab).to(target_probs)
    result = tokenwise(torch.tensor(tokens, dtype=torch.long), draft_probs,
                       torch.cat([target_probs, placeholder]), generator)
    if result.num_accepted == n:
        return n, None
    return result.num_accepted, int(result.tokens[-1])


class Pearl(OverlappedDraftAlgorithm):
    name = "pearl"

    def __init__(self, target, draft, *, gamma: int = 4, executor: str = "sequential", **kwargs):
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1 (draft tokens per round), got {gamma}")
        super().__init__(target, draft, executor=executor, max_batch=1, **kwargs)
        self.gamma = gamma

    @classmethod
    def options_from_config(cls, cfg) -> dict:
        return {"gamma": cfg.gamma, "executor": cfg.executor, "draft_path": cfg.drafter}

    def lookahead(self) -> int:
        return 2 * self.gamma  # the pending segment plus a fresh draft sit in the draft cache at once

    def _generate(self, prompt_ids: list[int], out: OutputBuffer, sampling: SamplingParams,
                  generator: torch.Generator | None, stats: GenerationStats) -> None:
        target, executor = self.target, self.executor  # built (a process started) before the clock starts
        start = time.perf_counter()
        target.reset(1)
        self.start_draft(generator)
        committed = list(prompt_ids)  # S
        pending: list[int] = []  # U: drafted after S, judged next round
        pending_q: torch.Tensor | None = None  # their draft distributions (None when greedy)
        while not out.done:
            context = committed + pending
            cached = target.length()
            feed = context[cached:]

            def target_job(feed=feed):
                return target.forward(as_batch(feed, target.device)).logits[0]

            logits, draft = executor.overlap(target_job, "chain", context, self.gamma, sampling)
            stats.target_forwards += 1
            stats.draft_forwards += draft.forwards
            stats.drafted_tokens += self.gamma
            # Rows p(·|S), p(·|S,u_1), .., p(·|S,U): the last len(U)+1 positions of the block.
            target_probs = sampling.warp(logits[len(feed) - len(pending) - 1:]).float().cpu()
            judged = pending + draft.tokens[:1]
            judged_q = None if draft.probs is None else torch.cat(
                [pending_q if pending_q is not None else draft.probs[:0], draft.probs[:1]])
            accepted, correction = verify_without_bonus(judged, judged_q, target_probs, generator)
            stats.record_round(len(judged), accepted)
            stats.drafted_tokens -= len(judged)  # counted when drafted (above); record_round counts judged ones
            if correction is None:
                new = judged
                pending, pending_q = draft.tokens[1:], None if draft.probs is None else draft.probs[1:]
            else:
                new = judged[:accepted] + [correction]
                pending, pending_q = [], None
            out.extend(new)
            committed += new
            # Target cache: keep the accepted prefix; the last committed token is fed next round.
            target.truncate(min(common_prefix(context, committed), len(committed) - 1))
        self.note_generation(time.perf_counter() - start, len(out.tokens))
