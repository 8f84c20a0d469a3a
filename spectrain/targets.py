"""The training target, loaded once per process (or built weightless for dry runs) and how it renders prompts."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

import torch

from core.assets import chat_template_hash, load_tokenizer, resolve_model_dir
from inference.drafters import LoadedModel, load_lm

_WEIGHTLESS = False  # set by weightless_targets(): dry runs build targets without reading their weights


@contextlib.contextmanager
def weightless_targets() -> Iterator[None]:
    """Inside the block ``loaded_target`` returns the target built on the meta device: its config, tokenizer and
    every tensor shape, but no weights read and no memory used, so a dry run validates an 8B recipe on a CPU."""
    global _WEIGHTLESS
    previous, _WEIGHTLESS = _WEIGHTLESS, True
    try:
        yield
    finally:
        _WEIGHTLESS = previous


def loaded_target(name: str, max_len: int, batch_size: int, device: str = "auto", chat_template: str = "auto"):
    """The target, loaded once per process and shared by the LightningModule and the online DataModule;
    ``chat_template`` (auto|none|PATH) sets how its tokenizer renders conversations."""
    if _WEIGHTLESS:
        return _weightless_target(name, chat_template)
    return _loaded_target(name, max_len, batch_size, device, chat_template)


@functools.lru_cache(maxsize=2)
def _loaded_target(name: str, max_len: int, batch_size: int, device: str, chat_template: str):
    if device == "auto" and torch.cuda.is_available():
        # Multi-GPU launchers start one process per GPU and set LOCAL_RANK: each rank's target on its own GPU.
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return load_lm(name, device=device, max_seq_len=max_len, max_batch_size=batch_size, chat_template=chat_template)


@functools.lru_cache(maxsize=2)
def _weightless_target(name: str, chat_template: str):
    """A ``LoadedModel`` whose model lives on the meta device and that has no runner (nothing can run)."""
    from transformers import (  # transformers is heavy: imported for dry runs only
        AutoConfig,
        AutoModelForCausalLM,
    )

    config = AutoConfig.from_pretrained(resolve_model_dir(name))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return LoadedModel(str(name), None, load_tokenizer(name, chat_template), model.eval())


def trained_template(cfg: Any) -> dict[str, str]:
    """How a run's conversations were rendered, for its checkpoints' target record (``assets.check_chat_template``
    compares it where the drafter serves)."""
    tokenizer = loaded_target(
        cfg.target, cfg.data.max_len, cfg.data.batch_size, chat_template=cfg.data.chat_template
    ).tokenizer
    return {"chat_template": cfg.data.chat_template, "chat_template_hash": chat_template_hash(tokenizer)}
