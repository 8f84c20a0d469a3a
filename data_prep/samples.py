"""Source conversation ``i`` -> training tokens, deterministically from ``i`` (what makes resume exact).

Shared by offline extraction and the online DataModule, so both see the same samples in the same order.
A conversation that leaves no assistant token inside its ``max_len`` window has nothing to learn from and is
skipped (the manifest counts it); a prompt-only source (mt_bench, humaneval) therefore needs ``regenerate=true``.

Where the window sits (``window``): ``start`` keeps the first ``max_len`` tokens (EAGLE's and SpecForge's
truncation), which drops every conversation whose prompt alone fills the window (for ShareGPT at
``max_len=256``, 993 of 6,000). ``answer`` keeps those too: when the first ``max_len`` tokens hold no answer
token, the window starts ``max_len // 2`` tokens before the first answer token instead (the prompt's tail as
context, left-truncated). Conversations that had answer tokens in the first window are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import UserError
from core.prompts import Conversation, load_prompts, tokenize_conversation
from data_prep.regenerate import Regenerator

WINDOWS = ("start", "answer")


@dataclass(frozen=True)
class TokenSample:
    index: int  # position in the source stream (0-based)
    input_ids: list[int]
    loss_mask: list[int]  # 1 on assistant tokens (what the drafter learns), 0 elsewhere

    def __len__(self) -> int:
        return len(self.input_ids)


def load_source(source: str, n_samples: int, seed: int = 0, split: str = "all") -> list[Conversation]:
    """The first ``n_samples`` conversations of a prompt source (``core.prompts.load_prompts``)."""
    if n_samples < 1:
        raise UserError(f"n_samples must be >= 1, got {n_samples}")
    conversations = load_prompts(source, n=n_samples, seed=seed, split=split)
    if not conversations:
        hint = (
            "; a file written from one split (data_prep.regenerate split=train) holds none of the other: give "
            "validation its own source (data.val_source=...)"
            if split == "eval" and source.startswith("jsonl:")
            else ""
        )
        raise UserError(f"source '{source}' (split={split}) gave no conversations{hint}")
    return conversations


class SampleBuilder:
    """``builder(index, conversation) -> TokenSample | None`` (None: no assistant token to learn from)."""

    def __init__(self, tokenizer, max_len: int, regenerator: Regenerator | None = None, window: str = "start"):
        if max_len < 2:
            raise UserError(f"max_len must be >= 2, got {max_len}")
        if window not in WINDOWS:
            raise UserError(f"window must be one of {', '.join(WINDOWS)}, got '{window}'")
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.regenerator = regenerator
        self.window = window

    def __call__(self, index: int, conversation: Conversation) -> TokenSample | None:
        if self.regenerator is not None:
            conversation = self.regenerator(index, conversation)
        if not any(t["role"] == "assistant" for t in conversation.turns):
            return None
        if self.window == "start":
            ids, mask = tokenize_conversation(self.tokenizer, conversation, max_len=self.max_len)
        else:
            ids, mask = answer_window(*tokenize_conversation(self.tokenizer, conversation), self.max_len)
        return TokenSample(index, ids, mask) if any(mask) else None


def answer_window(ids: list[int], mask: list[int], max_len: int) -> tuple[list[int], list[int]]:
    """The first ``max_len`` tokens if they hold an answer token, else the ``max_len`` tokens starting
    ``max_len // 2`` before the first answer token (``window=answer``)."""
    if len(ids) <= max_len or any(mask[:max_len]) or not any(mask):
        return ids[:max_len], mask[:max_len]
    start = mask.index(1) - max_len // 2
    return ids[start : start + max_len], mask[start : start + max_len]


def require_answers(conversations: list[Conversation], regenerate: bool, source: str) -> None:
    """Refuse a prompt-only source without regeneration: every sample would be skipped."""
    if not regenerate and not any(t["role"] == "assistant" for c in conversations for t in c.turns):
        raise UserError(
            f"source '{source}' has no assistant turns to learn from; add regenerate=true to answer "
            "its prompts with the target"
        )
