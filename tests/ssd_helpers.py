"""A tiny draft runner for SSD."""

from __future__ import annotations

from tiny_targets import tiny_llama

from inference.runner import ModelRunner


def tiny_draft_runner(seed: int, vocab: int = 128, max_batch_size: int = 3) -> ModelRunner:
    """Picklable drafter builder for the executors (the child process builds its own)."""
    return ModelRunner.from_hf_model(
        tiny_llama(seed, vocab=vocab, layers=1, temperature_scale=8.0), max_seq_len=256, max_batch_size=max_batch_size
    )
