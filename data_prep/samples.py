"""Source conversation ``i`` -> training tokens, deterministically from ``i`` (what makes resume exact).

Shared by offline extraction and the online DataModule, so both see the same samples in the same order.
A conversation that leaves no assistant token inside ``max_len`` has nothing to learn from and is skipped
(the manifest counts it); a prompt-only source (mt_bench, humaneval) therefore needs ``regenerate=true``.
"""

from __future__ import annotations

from dataclasses import dataclass

from data_prep.prompts import Conversation, load_prompts, tokenize_conversation
from data_prep.regenerate import Regenerator


@dataclass(frozen=True)
class TokenSample:
    index: int  # position in the source stream (0-based)
    input_ids: list[int]
    loss_mask: list[int]  # 1 on assistant tokens (what the drafter learns), 0 elsewhere

    def __len__(self) -> int:
        return len(self.input_ids)


def load_source(source: str, n_samples: int, seed: int = 0, split: str = "all") -> list[Conversation]:
    """The first ``n_samples`` conversations of a prompt source (``data_prep.prompts.load_prompts``)."""
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    conversations = load_prompts(source, n=n_samples, seed=seed, split=split)
    if not conversations:
        raise ValueError(f"source '{source}' (split={split}) gave no conversations")
    return conversations


class SampleBuilder:
    """``builder(index, conversation) -> TokenSample | None`` (None: no assistant token to learn from)."""

    def __init__(self, tokenizer, max_len: int, regenerator: Regenerator | None = None):
        if max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {max_len}")
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.regenerator = regenerator

    def __call__(self, index: int, conversation: Conversation) -> TokenSample | None:
        if self.regenerator is not None:
            conversation = self.regenerator(index, conversation)
        if not any(t["role"] == "assistant" for t in conversation.turns):
            return None
        ids, mask = tokenize_conversation(self.tokenizer, conversation, max_len=self.max_len)
        return TokenSample(index, ids, mask) if any(mask) else None


def require_answers(conversations: list[Conversation], regenerate: bool, source: str) -> None:
    """Refuse a prompt-only source without regeneration: every sample would be skipped."""
    if not regenerate and not any(t["role"] == "assistant" for c in conversations for t in c.turns):
        raise ValueError(f"source '{source}' has no assistant turns to learn from; add regenerate=true to answer "
                         "its prompts with the target")
