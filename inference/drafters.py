"""Loading what the engine runs: the target (runner + tokenizer) and drafters, with compatibility checks.

A draft LM is any causal-LM directory (an exported ``draft_lm`` or a plain HF directory) or a registry name; it
must share the target's tokenizer, because draft token ids are verified as target token ids. Every other drafter
is an export directory of ``python -m spectrain.export``, loaded by its kind's loader (``core.drafters.kinds``);
it must record the very target it runs with.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core import assets
from core.assets import tokenizer_fingerprint
from core.drafters.kinds import engine_kind, engine_kinds
from core.errors import UserError
from inference.device import cpu_has_native_bf16
from inference.drafter_index import export_kind
from inference.runner_loading import load_runner


def pick_device(device: str = "auto") -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device={device} but CUDA is not available; use device=cpu")
    return device


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def model_dtype(name: str, device: str) -> torch.dtype | None:
    """The compute dtype ``dtype=NAME`` asks for on ``device``; None for ``auto`` (fp32 on a CPU, bf16 on CUDA).
    bf16 on a CPU runs in exact mode (inference.llama.EXACT_ROWS), so greedy output still equals AR's token for
    token; it is refused where the CPU would only emulate it."""
    if name == "auto":
        return None
    if name not in DTYPES:
        raise UserError(f"dtype={name} is not supported; use auto, {' or '.join(DTYPES)}")
    if name == "bf16" and not str(device).startswith("cuda") and not cpu_has_native_bf16():
        raise UserError(
            "dtype=bf16 needs a CPU with native bf16 (AVX512-BF16 or AMX), which this one lacks: it "
            "would be emulated and slow; use dtype=fp32"
        )
    return DTYPES[name]


def serving_dtype(name: str) -> str:
    """``auto`` for pipelines that serve on this machine: bf16 where the CPU computes it natively (exact mode, and verifying a few tokens costs about one decode step, as on a GPU), else fp32; any other name as given."""
    if name != "auto":
        return name
    return "bf16" if torch.cuda.is_available() or cpu_has_native_bf16() else "fp32"


def eos_token_ids(tokenizer, model_config=None) -> list[int]:
    """Every id that ends an answer: the tokenizer's EOS and the generation config's / model config's."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = getattr(model_config, "eos_token_id", None) if model_config is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    # (looked up, and read back to tell it from the unknown token's id: get_vocab() builds the whole vocabulary)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and tokenizer.convert_ids_to_tokens(im_end) == "<|im_end|>":
        ids.add(im_end)  # chat models end a turn with it even when config.eos says otherwise
    return sorted(ids)


@dataclass
class LoadedModel:
    name: str
    runner: Any
    tokenizer: Any
    model: Any  # the transformers model (weights shared with the runner where possible)


def load_lm(
    name_or_path: str,
    *,
    device: str = "auto",
    max_seq_len: int = 2048,
    max_batch_size: int = 1,
    backend: str = "auto",
    dtype: torch.dtype | None = None,
    exact: bool | None = None,
    chat_template: str | None = None,
) -> LoadedModel:
    """A model with its runner and tokenizer; ``chat_template`` (auto|none|PATH) as ``assets.load_tokenizer``."""
    device = pick_device(device)
    model = assets.load_model(name_or_path, device=device, dtype=dtype)  # first: it names a path that is no model
    tokenizer = assets.load_tokenizer(name_or_path, chat_template)
    runner = load_runner(
        model,
        backend=backend,
        device=device,
        dtype=dtype,
        max_seq_len=max_seq_len,
        max_batch_size=max_batch_size,
        exact=exact,
    )
    return LoadedModel(str(name_or_path), runner, tokenizer, model)


def load_draft_lm(name_or_path: str, target: LoadedModel, **kw) -> LoadedModel:
    """Load a draft LM and refuse (one line) one whose tokenizer or vocabulary differs from the target's."""
    kind = export_kind(Path(name_or_path))
    record = engine_kinds().get(kind) if kind is not None else None
    if kind is not None and (record is None or record.load is not None):  # e.g. an EAGLE-3 export: no causal LM
        raise UserError(
            f"drafter '{name_or_path}' is an export of kind {kind}, not a draft LM: give a draft_lm "
            f"export or a causal-LM directory (or use this one with an algorithm for {kind} drafters)"
        )
    draft = load_lm(name_or_path, **kw)
    if tokenizer_fingerprint(draft.tokenizer) != tokenizer_fingerprint(target.tokenizer):
        raise UserError(
            f"drafter '{name_or_path}' has a different tokenizer than target '{target.name}': a drafter "
            "must be trained for this target's tokenizer"
        )
    if draft.runner.config.vocab_size != target.runner.config.vocab_size:
        raise UserError(
            f"drafter '{name_or_path}' has vocab_size {draft.runner.config.vocab_size} but target "
            f"'{target.name}' has {target.runner.config.vocab_size}"
        )
    block = getattr(draft.model.config, "spectrain", None)  # a spectrain export records how it was trained
    assets.check_chat_template(f"drafter '{name_or_path}'", (block or {}).get("target"), target.tokenizer)
    return draft


def load_drafter(
    kind: str, path: str, target: LoadedModel, *, device: str = "auto", max_seq_len: int = 2048, max_batch_size: int = 1
) -> Any:
    """The object an algorithm takes from a drafter of kind ``kind`` (``core.drafters.kinds``): a draft-LM runner
    (a causal LM), or the drafter module the kind's loader builds. Every drafter computes in the target runner's
    dtype."""
    load = engine_kind(kind).load
    if load is None:
        # A draft's tokens are only proposals: it needs no batch invariance, and its forwards are cheaper without.
        return load_draft_lm(
            path,
            target,
            device=device,
            max_seq_len=max_seq_len,
            max_batch_size=max_batch_size,
            dtype=target.runner.dtype,
            exact=False,
        ).runner
    return load(path, target)
