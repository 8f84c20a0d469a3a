"""The main job on the embedded default (``make demo``).

Answers the first MT-Bench questions with SmolLM2-135M-Instruct on the bundled engine and prints each answer
with its tokens/s. Later stages (extract -> train drafters -> export -> evaluate all algorithms) join here as
they land.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import torch

from inference.algorithms import build_algorithm
from inference.algorithms.base import GenerationStats
from inference.drafters import eos_token_ids, load_lm
from inference.sampling import SamplingParams


def main(argv: Sequence[str] | None = None) -> int:
    from data_prep.prompts import load_prompts, prompt_turns, render_prompt

    n_questions, max_new_tokens = 3, 128
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"[demo] stage 1/1: answer {n_questions} MT-Bench questions with SmolLM2-135M-Instruct "
          f"(engine, greedy, ≤{max_new_tokens} new tokens each; about a minute on a 2-core CPU)", flush=True)
    start = time.perf_counter()
    target = load_lm("smollm2", max_seq_len=1024)
    print(f"[demo] target loaded on {target.runner.device} in {time.perf_counter() - start:.1f} s", flush=True)
    ar = build_algorithm("ar", target.runner)
    eos = eos_token_ids(target.tokenizer, target.model.config)
    total = GenerationStats()
    for i, conversation in enumerate(load_prompts("mt_bench", n=n_questions), 1):
        prompt = render_prompt(target.tokenizer, prompt_turns(conversation))
        result = ar.generate(prompt, max_new_tokens=max_new_tokens, sampling=SamplingParams(0.0), eos_ids=eos)
        total.merge(result.stats)
        answer = target.tokenizer.decode(result.tokens, skip_special_tokens=True).strip()
        print(f"\n=== Q{i} [{conversation.meta.get('category', 'mt_bench')}] {conversation.first_user_message}\n")
        print(answer)
        print(f"\n--- {result.stats.new_tokens} tokens, {result.stats.tokens_per_s:.1f} tokens/s")
    print(f"\n[demo] {total.new_tokens} tokens in {total.wall_s:.1f} s: {total.tokens_per_s:.1f} tokens/s "
          f"(engine AR, {target.runner.device})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
