"""Replace a conversation's assistant turns with the target's own answers, generated with the engine (``ar``).

Training a drafter on the target's own outputs is the standard fix for low acceptance (USER_PAIN_POINTS 1).
Turn k is answered conditioned on the target's earlier answers (``prompt_turns``). Answers stop at the
target's EOS or when the conversation reaches ``max_len`` tokens (nothing past it is trained on). Sampling
(``temperature > 0``) draws from a generator seeded by (seed, source index), so a resumed run regenerates
exactly what an uninterrupted one would.
"""

from __future__ import annotations

import torch

from data_prep.prompts import Conversation, prompt_turns, render_prompt
from inference.algorithms import build_algorithm
from inference.sampling import SamplingParams


class Regenerator:
    def __init__(self, runner, tokenizer, eos_ids: list[int], *, max_len: int, max_new_tokens: int,
                 temperature: float = 0.0, seed: int = 0):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if runner.max_seq_len < max_len + 1:
            raise ValueError(f"the target runner holds {runner.max_seq_len} tokens; regenerating up to "
                             f"max_len={max_len} needs max_seq_len >= {max_len + 1}")
        self.algorithm = build_algorithm("ar", runner)
        self.tokenizer = tokenizer
        self.eos_ids = list(eos_ids)
        self.max_len = max_len
        self.max_new_tokens = max_new_tokens
        self.sampling = SamplingParams(temperature)
        self.seed = seed

    def describe(self) -> dict:
        """What the manifest records about regeneration."""
        return {"engine": "inference.algorithms.ar", "max_new_tokens": self.max_new_tokens,
                "temperature": self.sampling.temperature, "seed": self.seed}

    def __call__(self, index: int, conversation: Conversation) -> Conversation:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        answers: list[str] = []
        n_users = len(conversation.user_turns)
        while len(answers) < n_users:
            turns = prompt_turns(conversation, answers)
            ids = render_prompt(self.tokenizer, turns)
            budget = min(self.max_new_tokens, self.max_len - len(ids))
            if budget < 1:  # the prompt alone fills max_len: later turns would be cut off anyway
                break
            tokens = self.algorithm.generate(ids, max_new_tokens=budget, sampling=self.sampling,
                                             generator=generator, eos_ids=self.eos_ids).tokens
            if tokens and tokens[-1] in self.eos_ids:
                tokens = tokens[:-1]  # the chat template adds the end-of-turn token itself
            answers.append(self.tokenizer.decode(tokens, skip_special_tokens=True))
        if not answers:
            return Conversation(conversation.id, prompt_turns(conversation), conversation.source,
                                conversation.meta)
        turns = prompt_turns(conversation, answers[:-1]) + [{"role": "assistant", "content": answers[-1]}]
        return Conversation(conversation.id, turns, conversation.source, {**conversation.meta, "regenerated": True})
