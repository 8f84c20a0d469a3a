"""Tiny random Llama targets: in memory (``tiny_llama``, a runner over one, transformers' own greedy tokens) or
with SmolLM2's real tokenizer, saved as HF directories (fast, offline)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from core.assets import load_tokenizer
from inference.runner import ModelRunner
from inference.sampling import SamplingParams

SMOLLM2_VOCAB = 49152


def save_tiny_target(
    directory: Path, *, seed: int = 0, layers: int = 8, hidden: int = 32, noise: float = 0.0, logit_scale: float = 1.0
) -> Path:
    """A random LlamaForCausalLM (vocab 49152, untied lm_head: a tied one just repeats its input) plus SmolLM2's tokenizer in ``directory``.

    ``noise`` > 0 perturbs every weight (after seeding the same init): a draft that partly agrees with the
    unperturbed model of the same seed. ``logit_scale`` multiplies the lm_head: sharper logits keep greedy choices
    far from ties, so kernel rounding (e.g. a batched forward's) cannot flip them."""
    tokenizer = smollm2_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=SMOLLM2_VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    if noise:
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(noise * torch.randn(param.shape, generator=generator))
    if logit_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@functools.cache
def smollm2_tokenizer():
    """SmolLM2's tokenizer, loaded once per process (a load takes most of a second; it is only read and saved)."""
    return load_tokenizer("smollm2")


def write_jsonl(path: Path, n: int, *, prompt_only_every: int = 0) -> Path:
    """``n`` short chats (some multi-turn, some with a system prompt); every ``prompt_only_every``-th record
    has no assistant turn (so it is skipped by extraction)."""
    lines = []
    for i in range(n):
        if prompt_only_every and i % prompt_only_every == prompt_only_every - 1:
            lines.append({"prompt": f"Say something about the number {i}."})
            continue
        messages = [
            {"role": "user", "content": f"What is {i} plus {i}?"},
            {"role": "assistant", "content": f"{i} plus {i} is {2 * i}." + " Indeed." * (i % 5)},
        ]
        if i % 3 == 0:
            messages = [{"role": "system", "content": "Answer briefly."}] + messages
        if i % 4 == 1:
            messages += [
                {"role": "user", "content": "And times two?"},
                {"role": "assistant", "content": f"{i} times two is {2 * i}."},
            ]
        lines.append({"id": f"chat-{i}", "messages": messages})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def set_random_vocab_map(drafter, vocab: int, draft_vocab: int) -> None:
    """A random reduced draft vocabulary for ``drafter``: ``draft_vocab`` of the ``vocab`` ids, drawn from the global
    RNG (sorted, as a trained map's are)."""
    used = torch.sort(torch.randperm(vocab)[:draft_vocab]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    drafter.set_vocab_map(used - torch.arange(draft_vocab), t2d)


GREEDY = SamplingParams(temperature=0)


def tiny_llama(
    seed: int,
    vocab: int = 97,
    layers: int = 2,
    temperature_scale: float = 1.0,
    *,
    hidden: int = 32,
    intermediate: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 256,
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper or flatter output distributions, to vary acceptance
        model.lm_head.weight.mul_(temperature_scale)
    return model


def runner(model, max_seq_len: int = 192, exact: bool | None = None, rows: int = 1) -> ModelRunner:
    return ModelRunner.from_hf_model(model, max_seq_len=max_seq_len, exact=exact, max_batch_size=rows)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()
