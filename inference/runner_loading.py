"""Pick and build a target runner for a model, and give a draft LM's runner a narrowed vocabulary."""

from __future__ import annotations

import os

import torch

from inference.runner import ModelRunner
from inference.runner_contract import SUPPORTED_MODEL_TYPES, check_logit_vocab, window_matters
from inference.transformers_runner import TransformersRunner


def load_runner(
    model_or_path,
    *,
    backend: str = "auto",
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    max_batch_size: int = 1,
    max_seq_len: int = 2048,
    exact: bool | None = None,
) -> ModelRunner | TransformersRunner:
    """A runner for a transformers model instance (or a local HF model directory): :class:`ModelRunner` for
    supported model types (``backend="auto"`` or ``"native"``) whose sliding window, if any, is no shorter than
    ``max_seq_len``; :class:`TransformersRunner` otherwise or with ``backend="transformers"``. ``exact``: see
    :class:`ModelRunner` (None = its default)."""
    if backend not in ("auto", "native", "transformers"):
        raise ValueError(f"backend must be auto, native or transformers, got {backend!r}")
    model = model_or_path
    if isinstance(model_or_path, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM  # transformers: a heavy import, deferred to first use

        model = AutoModelForCausalLM.from_pretrained(model_or_path, dtype=dtype, local_files_only=True)
    kw = {"dtype": dtype, "max_batch_size": max_batch_size, "max_seq_len": max_seq_len}
    if device is not None:
        kw["device"] = device
    # ModelRunner has no sliding window: a config whose window is shorter than the context goes to transformers.
    native = getattr(model.config, "model_type", None) in SUPPORTED_MODEL_TYPES and not window_matters(
        model.config, max_seq_len
    )
    if backend == "native" or (backend == "auto" and native):
        return ModelRunner.from_hf_model(model, exact=exact, **kw)
    return TransformersRunner.from_hf_model(model, **kw)


def with_logit_vocab(runner: ModelRunner | TransformersRunner, vocab: int | None) -> ModelRunner | TransformersRunner:
    """``runner``'s model (weights shared, not copied) with its own cache, whose logits score only the ``vocab``
    lowest token ids (the rest are -inf). For a draft LM: SmolLM2-style BPE vocabularies are ordered roughly by
    merge frequency, so the lowest ids hold most generated tokens, and on a CPU the lm_head is most of a small
    draft's forward. Lossless wherever the drafter is used: its proposals simply have probability 0 outside the
    range, and verification corrects to the target's token. ``vocab`` None / 0 returns ``runner`` itself."""
    vocab = check_logit_vocab(vocab, runner.config.vocab_size)
    if vocab == runner.logit_vocab:
        return runner
    if isinstance(runner, ModelRunner):
        view = ModelRunner.from_config(
            runner.config,
            runner.state_dict(),
            device=runner.device,
            dtype=runner.dtype,
            max_batch_size=runner.max_batch_size,
            max_seq_len=runner.max_seq_len,
            exact=runner.exact,
        )
    else:
        view = TransformersRunner(runner.model, max_batch_size=runner.max_batch_size, max_seq_len=runner.max_seq_len)
    view.logit_vocab = vocab
    return view


def limited_draft(draft, vocab: int | None):
    """``draft`` scoring only the ``vocab`` lowest ids (:func:`with_logit_vocab`) when ``vocab`` is set and it does
    not already: an algorithm built with ``draft_vocab=N`` drafts from such a runner whoever built it (the engine
    passes one limited runner, shared by its algorithms, which comes back as it is)."""
    if not vocab or getattr(draft, "logit_vocab", None) == vocab:
        return draft
    return with_logit_vocab(draft, vocab)
