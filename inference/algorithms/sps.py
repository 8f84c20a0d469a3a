"""Chain speculative decoding with a draft LM (Leviathan et al. / Chen et al.), any chain verifier.

Each round the draft LM proposes γ tokens one forward at a time, the target scores all of them in ONE forward,
and a chain verifier (tokenwise, block = HSD capped, or the lossy HSD-uncapped rule) keeps a prefix plus one
correction/bonus token. Both KV caches are then rolled back to the kept tokens.

Cache bookkeeping: every emitted token is eventually fed to both models. ``target_pending`` / ``draft_pending``
hold the emitted tokens a model has not seen yet (the target always lags by the last emitted token; the draft
also lags by the last draft token after a fully accepted round, which it never ran).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from inference.algorithms.base import Algorithm, GenerationStats, OutputBuffer
from inference.runner_contract import as_batch, check_same_vocab
from inference.sampling import SamplingParams, sample
from inference.verify import ChainVerifier, get_verifier


@dataclass(frozen=True)
class RoundInfo:
    """One verification round, handed to ``SpeculativeSampling(on_round=...)`` (acceptance traces).

    The branch token is the first drafted token. The target's hidden states are taken at the position before it
    (the last emitted token, whose output predicted the branch token), in the runner's capture convention: layer
    i = output of decoder layer i (0-based); ``last_hidden`` is after the final norm.
    """

    index: int  # round number within this generation, from 0
    prefix_len: int  # tokens before the branch token (prompt + emitted so far), i.e. the branch token's position
    draft_tokens: list[int]  # the drafted chain; draft_tokens[0] is the branch token
    draft_probs: list[float]  # probability of each drafted token under the draft's temperature-1 softmax
    draft_max_probs: list[float]  # max_v of that softmax at each step (SpecBranch's draft confidence)
    num_accepted: int  # leading drafted tokens the verifier kept
    hidden: dict[int, torch.Tensor]  # {layer: [H]} target hidden states at position prefix_len - 1
    last_hidden: torch.Tensor  # [H] final-normed target hidden state at position prefix_len - 1


RoundHook = Callable[[RoundInfo], None]


class SpeculativeSampling(Algorithm):
    name = "sps"
    drafter = "draft_lm"

    def __init__(self, target, draft, *, gamma: int = 4, verifier: str | ChainVerifier = "tokenwise",
                 max_seq_len: int | None = None, on_round: RoundHook | None = None,
                 round_capture_layers: Sequence[int] = (), **verifier_kwargs):
        """``on_round`` (optional) receives a :class:`RoundInfo` after every verification, with the target's
        hidden states of ``round_capture_layers``; without it nothing extra is computed or kept."""
        super().__init__(target, max_seq_len=max_seq_len)
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1 (draft tokens per round), got {gamma}")
        check_same_vocab(target, draft)
        self.draft = draft
        self.gamma = gamma
        self.max_seq_len = min(self.max_seq_len, draft.max_seq_len)
        self.verifier = get_verifier(verifier, **verifier_kwargs) if isinstance(verifier, str) else verifier
        self.on_round = on_round
        self.round_capture_layers = tuple(round_capture_layers)

    @classmethod
    def options_from_config(cls, cfg) -> dict:
        options = {"gamma": cfg.gamma, "verifier": cfg.verifier}
        if cfg.verifier == "hsd":
            options["final_ratio"] = cfg.hsd_final_ratio
        return options

    def lookahead(self) -> int:
        return self.gamma + 1

    def _draft_chain(self, pending: list[int], gamma: int, sampling: SamplingParams,
                     generator: torch.Generator | None, stats: GenerationStats, raw_logits: list | None = None):
        """γ draft tokens and, when sampling, the warped distributions they were drawn from (``raw_logits``, if
        given, collects each step's draft logits)."""
        draft, tokens, probs = self.draft, [], []
        feed = as_batch(pending, draft.device)
        for _ in range(gamma):
            logits = draft.forward(feed, only_last_logits=True).logits[0, -1]
            stats.draft_forwards += 1
            if raw_logits is not None:
                raw_logits.append(logits)
            q = sampling.warp(logits)
            token = sample(q, generator)
            tokens.append(token)
            probs.append(q)
            feed = token.view(1, 1)
        draft_tokens = torch.stack(tokens)
        # Greedy drafts are point masses: the deterministic-draft rule needs no q.
        return draft_tokens, (None if sampling.greedy else torch.stack(probs))

    def _generate(
        self,
        prompt_ids: list[int],
        out: OutputBuffer,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        stats: GenerationStats,
    ) -> None:
        target, draft = self.target, self.draft
        target.reset(1)
        draft.reset(1)
        # Prefill: the target gives the first token; the draft sees the prompt minus its last token, which
        # it reads together with the first new token in its first drafting forward.
        logits = target.forward(as_batch(prompt_ids, target.device), only_last_logits=True).logits[0, -1]
        stats.target_forwards += 1
        if len(prompt_ids) > 1:
            draft.forward(as_batch(prompt_ids[:-1], draft.device), only_last_logits=True)
            stats.draft_forwards += 1
        first = int(sample(sampling.warp(logits), generator))
        out.extend([first])
        target_pending, draft_pending = [first], [prompt_ids[-1], first]

        hooked = self.on_round is not None
        round_index = 0
        while not out.done:
            gamma = min(self.gamma, out.remaining)  # never draft past the token budget
            draft_len = draft.length()
            raw_logits = [] if hooked else None
            draft_tokens, draft_probs = self._draft_chain(draft_pending, gamma, sampling, generator, stats, raw_logits)

            target_len = target.length()
            block = torch.cat([as_batch(target_pending, target.device), draft_tokens.view(1, -1).to(target.device)], 1)
            output = target.forward(block, capture_layers=self.round_capture_layers if hooked else (),
                                    return_last_hidden=hooked)
            target_logits = output.logits[0, len(target_pending) - 1:]
            stats.target_forwards += 1
            result = self.verifier(draft_tokens, draft_probs, sampling.warp(target_logits), generator)
            accepted = result.num_accepted
            stats.record_round(gamma, accepted)
            if hooked:
                self._report_round(round_index, len(prompt_ids) + len(out.tokens), draft_tokens, raw_logits,
                                   accepted, output, len(target_pending) - 1)
                round_index += 1

            # Keep the pending tokens and the accepted draft prefix in both caches.
            target.truncate(target_len + len(target_pending) + accepted)
            draft_seen = len(draft_pending) + min(accepted, gamma - 1)
            draft.truncate(draft_len + draft_seen)
            emitted = [int(t) for t in result.tokens]
            out.extend(emitted)
            target_pending = [emitted[-1]]
            # After full acceptance the draft never ran its last token: feed it with the bonus token.
            draft_pending = emitted[-2:] if accepted == gamma else [emitted[-1]]

    def _report_round(self, index: int, prefix_len: int, draft_tokens: torch.Tensor, raw_logits: list,
                      accepted: int, output, before_branch: int) -> None:
        """Build the :class:`RoundInfo` for ``on_round``; ``before_branch`` indexes the block position before the
        branch token."""
        softmax = torch.stack(raw_logits).float().softmax(dim=-1)  # [γ, V], temperature 1
        tokens = draft_tokens.view(-1).to(softmax.device)
        self.on_round(RoundInfo(
            index=index,
            prefix_len=prefix_len,
            draft_tokens=tokens.tolist(),
            draft_probs=softmax.gather(1, tokens[:, None]).squeeze(1).tolist(),
            draft_max_probs=softmax.max(dim=-1).values.tolist(),
            num_accepted=accepted,
            hidden={layer: h[0, before_branch] for layer, h in output.hidden.items()},
            last_hidden=output.last_hidden[0, before_branch],
        ))
