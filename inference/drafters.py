"""Loading what the engine runs: the target (runner + tokenizer) and drafters, with compatibility checks.

A draft LM is any causal-LM directory (an exported ``draft_lm`` or a plain HF directory) or a registry name; it
must share the target's tokenizer, because draft token ids are verified as target token ids. An EAGLE-3 drafter
is an export directory of ``python -m spectrain.export``; it must record the very target it runs with.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from core import assets
from core.assets import target_record, tokenizer_fingerprint
from core.drafters import dflash_layouts, peagle_layouts
from core.drafters.eagle3_layouts import check_against_target, read_checkpoint, same_target
from core.drafters.specblock import build_drafter, read_native
from core.errors import UserError
from inference.device import cpu_has_native_bf16
from inference.drafter_index import export_kind
from inference.runner_loading import load_runner

if TYPE_CHECKING:
    from core.drafters.dflash import DFlashDrafter
    from core.drafters.eagle3 import Eagle3Drafter
    from core.drafters.peagle import PEagleDrafter
    from core.drafters.specblock import SpecBlockDrafter


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
        raise UserError("dtype=bf16 needs a CPU with native bf16 (AVX512-BF16 or AMX), which this one lacks: it "
                         "would be emulated and slow; use dtype=fp32")
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
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    if im_end is not None:  # chat models end a turn with it even when config.eos says otherwise
        ids.add(int(im_end))
    return sorted(ids)


@dataclass
class LoadedModel:
    name: str
    runner: Any
    tokenizer: Any
    model: Any  # the transformers model (weights shared with the runner where possible)


def load_lm(name_or_path: str, *, device: str = "auto", max_seq_len: int = 2048, max_batch_size: int = 1,
            backend: str = "auto", dtype: torch.dtype | None = None,
            exact: bool | None = None, chat_template: str | None = None) -> LoadedModel:
    """A model with its runner and tokenizer; ``chat_template`` (auto|none|PATH) as ``assets.load_tokenizer``."""
    device = pick_device(device)
    model = assets.load_model(name_or_path, device=device, dtype=dtype)  # first: it names a path that is no model
    tokenizer = assets.load_tokenizer(name_or_path, chat_template)
    runner = load_runner(model, backend=backend, device=device, dtype=dtype, max_seq_len=max_seq_len,
                         max_batch_size=max_batch_size, exact=exact)
    return LoadedModel(str(name_or_path), runner, tokenizer, model)


def load_draft_lm(name_or_path: str, target: LoadedModel, **kw) -> LoadedModel:
    """Load a draft LM and refuse (one line) one whose tokenizer or vocabulary differs from the target's."""
    kind = export_kind(Path(name_or_path))
    if kind not in (None, "draft_lm"):  # e.g. an EAGLE-3 export: its config.json is no causal LM's
        raise UserError(f"drafter '{name_or_path}' is an export of kind {kind}, not a draft LM: give a draft_lm "
                         f"export or a causal-LM directory (or use this one with an algorithm for {kind} drafters)")
    draft = load_lm(name_or_path, **kw)
    if tokenizer_fingerprint(draft.tokenizer) != tokenizer_fingerprint(target.tokenizer):
        raise UserError(f"drafter '{name_or_path}' has a different tokenizer than target '{target.name}': a drafter "
                         "must be trained for this target's tokenizer")
    if draft.runner.config.vocab_size != target.runner.config.vocab_size:
        raise UserError(f"drafter '{name_or_path}' has vocab_size {draft.runner.config.vocab_size} but target "
                         f"'{target.name}' has {target.runner.config.vocab_size}")
    block = getattr(draft.model.config, "spectrain", None)  # a spectrain export records how it was trained
    assets.check_chat_template(f"drafter '{name_or_path}'", (block or {}).get("target"), target.tokenizer)
    return draft


def load_eagle3(path: str, target: LoadedModel) -> Eagle3Drafter:
    """Load an EAGLE-3 export (any layout with a spectrain block) onto ``target``'s device and dtype, sharing its
    token embedding. Refuses (one line) a drafter trained for another target, hidden size or vocabulary."""
    ckpt = read_checkpoint(path)
    if ckpt.target is None:
        raise UserError(f"drafter '{path}' does not record its target; import it first: python -m spectrain.export "
                         f"import={path} target={target.name} out=DIR")
    record = target_record(target.name)
    if not same_target(ckpt.target, record):
        raise UserError(f"drafter '{path}' was trained for target '{ckpt.target.get('name')}' (config "
                         f"{ckpt.target.get('config_hash')}, weights {ckpt.target.get('weights_hash')}), not "
                         f"'{target.name}' (config {record['config_hash']}, weights {record['weights_hash']}): use a "
                         "drafter trained for this target")
    check_against_target(ckpt.config, record)
    assets.check_chat_template(f"drafter '{path}'", ckpt.target, target.tokenizer)
    runner = target.runner
    drafter = ckpt.build(embed_weight=runner.embed_tokens.weight)
    return drafter.to(device=runner.device, dtype=runner.dtype).eval()


def load_specblock(path: str, target: LoadedModel) -> SpecBlockDrafter:
    """Load a SpecBlock native export onto ``target``'s device and dtype, sharing its token embedding. Refuses
    (one line) a drafter trained for another target, hidden size, vocabulary or layer count."""
    config, tensors, block = read_native(path)
    check_native_target(path, config, block.get("target"), target)
    runner = target.runner
    drafter = build_drafter(config, tensors, embed_weight=runner.embed_tokens.weight)
    return drafter.to(device=runner.device, dtype=runner.dtype).eval()


def load_dflash(path: str, target: LoadedModel) -> DFlashDrafter:
    """Load a DFlash native export onto ``target``'s device and dtype, sharing its token embedding and head. Refuses
    (one line) a drafter trained for another target, hidden size, vocabulary or layer count."""
    config, tensors, block = dflash_layouts.read_native(path)
    check_native_target(path, config, block.get("target"), target)
    runner = target.runner
    drafter = dflash_layouts.build_drafter(config, tensors, embed_weight=runner.embed_tokens.weight,
                                           head_weight=runner.lm_head.weight)
    return drafter.to(device=runner.device, dtype=runner.dtype).eval()


def load_peagle(path: str, target: LoadedModel) -> PEagleDrafter:
    """Load a P-EAGLE export of ours (either layout) onto ``target``'s device and dtype, sharing its token embedding
    unless the drafter owns one. Refuses (one line) a drafter trained for another target, hidden size, vocabulary or
    layer count."""
    config, tensors, block = peagle_layouts.read_native(path)
    check_native_target(path, config, block.get("target"), target)
    runner = target.runner
    drafter = peagle_layouts.build_drafter(config, tensors, embed_weight=runner.embed_tokens.weight)
    return drafter.to(device=runner.device, dtype=runner.dtype).eval()


def check_native_target(path: str, config: Any, recorded: dict[str, Any] | None, target: LoadedModel) -> None:
    """Refuse (one line) a native export that records no target, another target, another vocabulary or hidden
    size, aux layers the target lacks, or another chat template."""
    if recorded is None:
        raise UserError(f"drafter '{path}' does not record its target; re-export it with its target record")
    record = target_record(target.name)
    if not same_target(recorded, record):
        raise UserError(f"drafter '{path}' was trained for target '{recorded.get('name')}' (config "
                         f"{recorded.get('config_hash')}, weights {recorded.get('weights_hash')}), not "
                         f"'{target.name}' (config {record['config_hash']}, weights {record['weights_hash']}): use a "
                         "drafter trained for this target")
    if (config.vocab_size, config.target_hidden_size) != (target.runner.config.vocab_size,
                                                          target.runner.config.hidden_size):
        raise UserError(f"drafter '{path}' expects vocab {config.vocab_size} / hidden {config.target_hidden_size} "
                         f"but target '{target.name}' has {target.runner.config.vocab_size} / "
                         f"{target.runner.config.hidden_size}: it was trained for another target")
    if max(config.aux_layer_ids) >= record["num_hidden_layers"]:
        raise UserError(f"drafter '{path}' reads aux layers {config.aux_layer_ids} that target '{target.name}' "
                         f"({record['num_hidden_layers']} layers) does not have")
    assets.check_chat_template(f"drafter '{path}'", recorded, target.tokenizer)


# What each algorithm drafter kind is loaded from: the export kind written by spectrain.export, and a hint.
DRAFTER_KINDS: dict[str, tuple[str, str]] = {
    "draft_lm": ("draft_lm", "a draft LM (an exported draft_lm or a HF directory sharing the target's tokenizer)"),
    "features": ("eagle3", "an EAGLE-3 export of python -m spectrain.export for this target"),
    "specblock": ("specblock", "a SpecBlock export of python -m spectrain.export for this target"),
    "dflash": ("dflash", "a DFlash export of python -m spectrain.export for this target"),
    "peagle": ("peagle", "a P-EAGLE export of python -m spectrain.export for this target"),
}


def load_drafter(kind: str, path: str, target: LoadedModel, *, device: str = "auto", max_seq_len: int = 2048,
                 max_batch_size: int = 1) -> Any:
    """The object an algorithm of drafter kind ``kind`` takes: a draft-LM runner, or a drafter module. Every
    drafter computes in the target runner's dtype."""
    if kind == "draft_lm":
        # A draft's tokens are only proposals: it needs no batch invariance, and its forwards are cheaper without.
        return load_draft_lm(path, target, device=device, max_seq_len=max_seq_len, max_batch_size=max_batch_size,
                             dtype=target.runner.dtype, exact=False).runner
    if kind == "features":
        return load_eagle3(path, target)
    if kind == "specblock":
        return load_specblock(path, target)
    if kind == "dflash":
        return load_dflash(path, target)
    if kind == "peagle":
        return load_peagle(path, target)
    raise UserError(f"unknown drafter kind '{kind}'; known: {', '.join(DRAFTER_KINDS)}")
