"""Test helpers over the engine loop: a request admitted alone, to read what its strategy holds after the prefill."""

from __future__ import annotations

from inference.engine.loop import DecodeEngine
from inference.engine.state import RowRequest, RowState
from inference.sampling import SamplingParams


def admitted_alone(algorithm, prompt: list[int], max_new_tokens: int = 32) -> tuple[DecodeEngine, RowState]:
    """``algorithm``'s one-row engine after admitting ``prompt`` greedily: the row's state holds its first token
    (``pending``) and the strategy's drafter-side state (``draft``: the prompt's target features and next tokens)."""
    engine = DecodeEngine(algorithm.target, algorithm.strategy(), rows=1, max_seq_len=algorithm.max_seq_len)
    room = algorithm.max_seq_len - len(prompt) - algorithm.lookahead()
    ended = engine.admit([RowRequest(0, prompt, min(max_new_tokens, room), SamplingParams(0.0))])
    if ended:
        raise AssertionError(f"the request ended at admission: {ended}")
    return engine, engine.slots[0]
