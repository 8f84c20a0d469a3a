"""Chain speculative decoding with a draft LM (Leviathan et al. / Chen et al.), any chain verifier.

Each round the draft LM proposes γ tokens one forward at a time, the target scores all of them in ONE forward,
and a chain verifier (tokenwise, block = HSD capped, or the lossy HSD-uncapped rule) keeps a prefix plus one
correction/bonus token. Both KV caches are then rolled back to the kept tokens.

Cache bookkeeping: every emitted token is eventually fed to both models. ``target_pending`` / ``draft_pending``
hold the emitted tokens a model has not seen yet (the target always lags by the last emitted token; the draft
also lags by the last draft token after a fully accepted round, which it never ran).
"""

from __future__ import annotations

import torch

from inference.algorithms.base import Algorithm, GenerationStats, OutputBuffer, as_batch
from inference.sampling import SamplingParams, sample
from inference.verify import ChainVerifier, get_verifier


def check_same_vocab(target, draft) -> None:
    """Refuse a drafter whose vocabulary differs from the target's (its token ids would mean other tokens)."""
    t_vocab, d_vocab = target.config.vocab_size, draft.config.vocab_size
    if t_vocab != d_vocab:
        raise ValueError(f"drafter vocab_size {d_vocab} differs from the target's {t_vocab}: the drafter must share "
                         "the target's tokenizer (train one with recipe=draftlm_* for this target)")


class SpeculativeSampling(Algorithm):
    name = "sps"
    drafter = "draft_lm"

    def __init__(self, target, draft, *, gamma: int = 4, verifier: str | ChainVerifier = "tokenwise",
                 max_seq_len: int | None = None, **verifier_kwargs):
        super().__init__(target, max_seq_len=max_seq_len)
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1 (draft tokens per round), got {gamma}")
        check_same_vocab(target, draft)
        self.draft = draft
        self.gamma = gamma
        self.max_seq_len = min(self.max_seq_len, draft.max_seq_len)
        self.verifier = get_verifier(verifier, **verifier_kwargs) if isinstance(verifier, str) else verifier

    @classmethod
    def options_from_config(cls, cfg) -> dict:
        options = {"gamma": cfg.gamma, "verifier": cfg.verifier}
        if cfg.verifier == "hsd":
            options["final_ratio"] = cfg.hsd_final_ratio
        return options

    def lookahead(self) -> int:
        return self.gamma + 1

    def _draft_chain(self, pending: list[int], gamma: int, sampling: SamplingParams,
                     generator: torch.Generator | None, stats: GenerationStats):
        """γ draft tokens and, when sampling, the warped distributions they were drawn from."""
        draft, tokens, probs = self.draft, [], []
        feed = as_batch(pending, draft.device)
        for _ in range(gamma):
            logits = draft.forward(feed, only_last_logits=True).logits[0, -1]
            stats.draft_forwards += 1
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

        while not out.done:
            gamma = min(self.gamma, out.remaining)  # never draft past the token budget
            draft_len = draft.length()
            draft_tokens, draft_probs = self._draft_chain(draft_pending, gamma, sampling, generator, stats)

            target_len = target.length()
            block = torch.cat([as_batch(target_pending, target.device), draft_tokens.view(1, -1).to(target.device)], 1)
            target_logits = target.forward(block).logits[0, len(target_pending) - 1:]
            stats.target_forwards += 1
            result = self.verifier(draft_tokens, draft_probs, sampling.warp(target_logits), generator)
            accepted = result.num_accepted
            stats.record_round(gamma, accepted)

            # Keep the pending tokens and the accepted draft prefix in both caches.
            target.truncate(target_len + len(target_pending) + accepted)
            draft_seen = len(draft_pending) + min(accepted, gamma - 1)
            draft.truncate(draft_len + draft_seen)
            emitted = [int(t) for t in result.tokens]
            out.extend(emitted)
            target_pending = [emitted[-1]]
            # After full acceptance the draft never ran its last token: feed it with the bonus token.
            draft_pending = emitted[-2:] if accepted == gamma else [emitted[-1]]
