"""EAGLE-3 checkpoint layouts: our native dir, SGLang's and speculators/vLLM's (docs/algorithms/eagle3_export.md).

All three hold ``config.json`` + ``model.safetensors``; tensor names differ only in the decoder layer's prefix:

| layout      | decoder layer | config                                                                     |
|-------------|---------------|----------------------------------------------------------------------------|
| native      | ``midlayer.`` | ``{"spectrain": {...}}`` only                                              |
| sglang      | ``midlayer.`` | HF Llama config, ``LlamaForCausalLMEagle3``, nested ``eagle_config``       |
| speculators | ``layers.0.`` | ``speculators_model_type: eagle3``, ``transformer_layer_config``, ...      |

Layer ids: ours and SGLang's ``eagle_config.eagle_aux_hidden_state_layer_ids`` are OUTPUT-of-layer ids; vLLM reads
only the TOP-level ``eagle_aux_hidden_state_layer_ids``, as INPUT-of-layer ids (= output id + 1). The sglang
layout writes both (each in its own convention) so vLLM serves it too; speculators writes the top-level one.
``d2t`` holds offsets in every layout (``target = draft + d2t[draft]``); ``t2d`` is written, engines skip it.
``norm_before_residual``: SGLang always takes the residual before ``hidden_norm`` (False), so a drafter trained
with True is refused for the sglang layout; speculators always writes the flag (vLLM defaults it to True).
Every layout also carries our ``spectrain`` block (target identity, layer convention) in ``config.json``.
The speculators layout names its verifier so that speculators/vLLM can load it (the target's local directory or a
hub id, never our alias) and ships the target's ``embed_tokens.weight`` (``target_embedding``); reading drops that
copy again when the ``spectrain`` block says the embedding is the target's.
EAGLE-3.1 (``fc_norm``, ``norm_output``; docs/algorithms/eagle3.md): native and speculators carry both flags
(speculators' top-level fields of the same names; ``fc_norm``'s tensors ``fc_norm.{0,1,2}.weight`` in every
layout); the sglang layout has no such fields, so a drafter with either flag is refused for it, and an sglang
config setting one is refused on reading. speculators' ``norm_before_fc`` (one norm over the concatenation) is not
run here and is refused.
Sliding window (``attention_window``, docs/algorithms/eagle3.md §8): native records it in the architecture;
speculators in its ``transformer_layer_config`` (``sliding_window``, ``use_sliding_window``, ``layer_types:
[sliding_attention]``, what the library's EAGLE-3 model reads); the sglang layout has no such field, so a windowed
drafter is refused for it.
Reading is strict: an unknown or missing tensor, or a flag we do not run, is a one-line error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.assets import AssetError, model_tensor, read_json
from core.drafters.checkpoint_files import (
    CheckpointError,
    check_against_target,
    config_or_none,
    read_weights,
    same_target,
    verifier_reference,
    vllm_layer_ids,
)
from core.drafters.eagle3 import EAGLE31_FLAGS, NUM_AUX_LAYERS, Eagle3Config, Eagle3Drafter, rope_of
from core.layer_ids import LAYER_CONVENTION, eagle3_layers
from core.vocab import check_vocab_mapping

LAYOUTS = ("native", "sglang", "speculators")
FORMAT_VERSION = 1
SGLANG_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # both map to vLLM's llama_eagle3
SPECULATORS_VERSION = "0.3.0"
LAYER_PREFIX = {"native": "midlayer.", "sglang": "midlayer.", "speculators": "layers.0."}
# Decoder-layer tensors (after the layer prefix) and the rest, as our module names them.
LAYER_TENSORS = (
    tuple(f"self_attn.{p}_proj.weight" for p in "qkvo")
    + tuple(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
    + tuple(f"{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"))
)
TOP_TENSORS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")
EMBED = "embed_tokens.weight"
# speculators flags we do not run: reading refuses them rather than drop them.
UNSUPPORTED_FLAGS = ("norm_before_fc",)
FC_NORM_TENSORS = tuple(f"fc_norm.{i}.weight" for i in range(NUM_AUX_LAYERS))


@dataclass
class Eagle3Checkpoint:
    """A drafter in transit: its config, tensors under our module names (``embed_tokens.weight`` only when
    ``config.own_embedding``), the target record (identity + shape facts) or None for a foreign checkpoint."""

    config: Eagle3Config
    tensors: dict[str, torch.Tensor]
    target: dict[str, Any] | None
    layout: str = "native"

    @classmethod
    def from_drafter(cls, drafter: Eagle3Drafter, target: dict[str, Any] | None) -> Eagle3Checkpoint:
        return cls(drafter.config, drafter_tensors(drafter.state_dict(), drafter.config), target)

    def check_shapes(self) -> None:
        """Every tensor must have the shape the config gives it (checked on the meta device: no allocation)."""
        with torch.device("meta"):
            reference = Eagle3Drafter(self.config).state_dict()
        for name, tensor in self.tensors.items():
            if tuple(tensor.shape) != tuple(reference[name].shape):
                raise CheckpointError(
                    f"tensor {name} has shape {tuple(tensor.shape)} but the config gives {tuple(reference[name].shape)}"
                )

    def build(self, embed_weight: torch.Tensor | None = None) -> Eagle3Drafter:
        """The module holding these tensors (no copies). ``embed_weight``: the target's embedding, shared; required
        unless the checkpoint carries its own."""
        self.check_shapes()
        if not self.config.own_embedding and embed_weight is None:
            raise CheckpointError("this drafter uses the target's token embedding: pass the target's embed weight")
        with torch.device("meta"):  # weights come from the checkpoint; don't initialise them first
            drafter = Eagle3Drafter(self.config)
        drafter.load_state_dict(self.tensors, strict=False, assign=True)
        if not self.config.own_embedding:
            drafter.use_target_embedding(embed_weight)
        drafter.embed_tokens.weight.requires_grad_(False)
        return drafter


def drafter_tensors(state_dict: dict[str, torch.Tensor], config: Eagle3Config) -> dict[str, torch.Tensor]:
    """What an export holds: the module's tensors, minus the target's embedding unless the drafter owns one."""
    expected = expected_names(config)
    unknown = sorted(set(state_dict) - expected - {EMBED})
    missing = sorted(expected - set(state_dict))
    if unknown or missing:
        raise CheckpointError(
            f"drafter state dict does not match EAGLE-3: unknown {unknown[:4]}, missing {missing[:4]}"
        )
    return {k: v.detach().cpu().contiguous() for k, v in state_dict.items() if k in expected}


def expected_names(config: Eagle3Config, layout: str = "native") -> set[str]:
    names = {LAYER_PREFIX[layout] + n for n in LAYER_TENSORS} | set(TOP_TENSORS)
    names |= set(FC_NORM_TENSORS) if config.fc_norm else set()
    return names | ({EMBED} if config.own_embedding else set())


# ----------------------------------------------------------------------------------------------------------
# Writing


def spectrain_block(ckpt: Eagle3Checkpoint, layout: str) -> dict[str, Any]:
    config = ckpt.config
    return {
        "format_version": FORMAT_VERSION,
        "kind": "eagle3",
        "layout": layout,
        "target": ckpt.target,
        "architecture": config.to_dict(),
        "layers": {
            "ids": list(config.aux_layer_ids),
            "convention": LAYER_CONVENTION,
            "vllm_input_ids": vllm_layer_ids(config.aux_layer_ids),
        },
        "vocab": {"vocab_size": config.vocab_size, "draft_vocab_size": config.draft_vocab_size},
        "embed_tokens": "own" if config.own_embedding else "target",
    }


def _llama_fields(config: Eagle3Config, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.resolved_head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "hidden_act": config.hidden_act,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def layout_config(
    ckpt: Eagle3Checkpoint, layout: str, *, dtype: torch.dtype, speculative_tokens: int = 3, verifier: str | None = None
) -> dict[str, Any]:
    """``config.json`` of ``layout``; refuses combinations an engine would load silently wrong. ``verifier``:
    what the speculators layout names as its verifier (a local HF directory or a hub id); default: the target's
    local directory (``portable_model_reference``), since speculators loads the verifier's embedding, final norm
    and head from it and takes any other string for a hub id."""
    config, block = ckpt.config, spectrain_block(ckpt, layout)
    if layout == "native":
        return {"spectrain": block}
    if ckpt.target is None:
        raise CheckpointError(
            f"the {layout} layout names the verifier: this checkpoint has no target record; give target=NAME_OR_DIR"
        )
    if layout == "sglang":
        flags = [flag for flag in EAGLE31_FLAGS if getattr(config, flag)]
        if flags:
            raise CheckpointError(
                f"the sglang layout has no EAGLE-3.1 fields but this drafter was trained with "
                f"{flags[0]}=true: export format=speculators (or native)"
            )
        if config.attention_window:
            raise CheckpointError(
                f"the sglang layout has no sliding-window field but this drafter attends over a "
                f"window of {config.attention_window} positions: export format=speculators "
                "(or native)"
            )
        if config.norm_before_residual:
            raise CheckpointError(
                "SGLang's llama_eagle3 takes the residual before hidden_norm "
                "(norm_before_residual=false) but this drafter was trained with true: export "
                "format=speculators for vLLM, or retrain with norm_before_residual=false"
            )
        return {
            "architectures": [SGLANG_ARCHITECTURES[0]],
            **_llama_fields(config, dtype),
            "draft_vocab_size": config.draft_vocab_size,
            "target_hidden_size": config.target_hidden_size,
            "norm_before_residual": False,  # what SGLang runs; explicit for vLLM (which defaults it to False here)
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
                "use_aux_hidden_state": True,
            },
            "eagle_aux_hidden_state_layer_ids": vllm_layer_ids(config.aux_layer_ids),  # vLLM: input-of-layer
            "spectrain": block,
        }
    if layout == "speculators":
        if speculative_tokens < 1:
            raise CheckpointError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
        layer = _llama_fields(config, dtype)
        layer.pop("torch_dtype")
        if config.attention_window:  # the fields speculators' Eagle3DraftModel reads (one layer, a sliding one)
            layer.update(
                sliding_window=config.attention_window, use_sliding_window=True, layer_types=["sliding_attention"]
            )
        return {
            "speculators_model_type": "eagle3",
            "architectures": ["Eagle3Speculator"],
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": layer,
            "draft_vocab_size": config.draft_vocab_size,
            "norm_before_residual": bool(config.norm_before_residual),  # always explicit: vLLM defaults to True
            "target_hidden_size": config.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": vllm_layer_ids(config.aux_layer_ids),
            "norm_before_fc": False,
            "fc_norm": bool(config.fc_norm),
            "norm_output": bool(config.norm_output),
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
                "default_proposal_method": "greedy",
                "verifier": {
                    "name_or_path": verifier or verifier_reference(ckpt.target),
                    "architectures": list(ckpt.target.get("architectures") or []),
                },
            },
            "torch_dtype": str(dtype).removeprefix("torch."),
            "spectrain": block,
        }
    raise CheckpointError(f"unknown layout '{layout}'; use one of {', '.join(LAYOUTS)}")


def layout_tensors(
    tensors: dict[str, torch.Tensor], layout: str, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Our tensor names -> ``layout``'s; floating tensors cast to ``dtype`` when given (d2t/t2d never)."""
    if layout not in LAYOUTS:
        raise CheckpointError(f"unknown layout '{layout}'; use one of {', '.join(LAYOUTS)}")
    out = {}
    for name, tensor in tensors.items():
        if name.startswith(LAYER_PREFIX["native"]):
            name = LAYER_PREFIX[layout] + name.removeprefix(LAYER_PREFIX["native"])
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[name] = tensor.contiguous()
    return out


def write_layout(
    ckpt: Eagle3Checkpoint,
    layout: str,
    directory: Path,
    *,
    dtype: torch.dtype | None = None,
    speculative_tokens: int = 3,
    verifier: str | None = None,
) -> None:
    """Write ``config.json`` and ``model.safetensors`` of ``layout`` into an existing ``directory``."""
    from safetensors.torch import save_file  # safetensors: a heavy import, deferred to first use

    dtype = dtype or ckpt.tensors["fc.weight"].dtype
    config = layout_config(ckpt, layout, dtype=dtype, speculative_tokens=speculative_tokens, verifier=verifier)
    tensors = ckpt.tensors
    if layout == "speculators" and EMBED not in tensors:
        tensors = {**tensors, EMBED: target_embedding(ckpt, verifier)}
    save_file(
        layout_tensors(tensors, layout, dtype),
        str(directory / "model.safetensors"),
        metadata={"format": "pt", "spectrain_layout": layout},
    )
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def target_embedding(ckpt: Eagle3Checkpoint, verifier: str | None) -> torch.Tensor:
    """The target's token embedding, for the speculators layout: ``Eagle3DraftModel.from_pretrained`` (speculators
    0.9.0) leaves a missing ``embed_tokens.weight`` as uninitialised memory (its NaN check for "not loaded" then
    fails) instead of reading it from the verifier (``tests/spectrain/test_speculators_interop.py``)."""
    source = verifier if verifier and Path(verifier).is_dir() else (ckpt.target or {}).get("name")
    try:
        return model_tensor(source, EMBED)
    except AssetError as exc:
        raise CheckpointError(
            f"the speculators layout ships the target's embedding, which could not be read "
            f"({exc}); give verifier=DIR, the target's local HF directory"
        ) from None


# ----------------------------------------------------------------------------------------------------------
# Reading


def detect_layout(config: dict[str, Any]) -> str:
    if "speculators_model_type" in config:
        if config["speculators_model_type"] != "eagle3":
            raise CheckpointError(f"speculators checkpoint of type '{config['speculators_model_type']}', not eagle3")
        return "speculators"
    architectures = config.get("architectures") or []
    if any(a in SGLANG_ARCHITECTURES for a in architectures):
        return "sglang"
    if "spectrain" in config and "model_type" not in config:
        return "native"
    raise CheckpointError(
        f"config.json is not an EAGLE-3 checkpoint (architectures {architectures}; expected "
        f"{' or '.join(SGLANG_ARCHITECTURES)}, speculators_model_type eagle3, or a spectrain block)"
    )


def read_checkpoint(path: str | Path, target: dict[str, Any] | None = None) -> Eagle3Checkpoint:
    """Read an EAGLE-3 directory in any layout (auto-detected). ``target`` (a target record) fills in what a
    foreign checkpoint lacks (identity; default layer ids) and is checked against what it states."""
    directory = Path(path)
    if not directory.exists():
        raise CheckpointError(
            f"drafter '{directory}' does not exist; give an export directory of python -m spectrain.export"
        )
    if not (directory / "config.json").is_file():
        if (directory / "model.safetensors").is_file():
            raise CheckpointError(
                f"{directory} has model.safetensors but no config.json: an interrupted or "
                "incomplete copy of an export; re-export it (python -m spectrain.export)"
            )
        raise CheckpointError(f"{directory} has no config.json: not an EAGLE-3 checkpoint directory")
    try:
        raw = read_json(directory / "config.json", fix="re-export the drafter (python -m spectrain.export)")
    except AssetError as exc:
        raise CheckpointError(str(exc)) from None
    block = raw.get("spectrain")
    kind = block.get("kind") if isinstance(block, dict) else None
    if kind not in (None, "eagle3"):  # an export contradicting itself must not run as an EAGLE-3 drafter
        raise CheckpointError(
            f"{directory}/config.json records a '{kind}' drafter, not eagle3: EAGLE-3 algorithms "
            "cannot load it; give an eagle3 export of python -m spectrain.export (or use this one "
            f"with an algorithm for {kind} drafters)"
        )
    layout = detect_layout(raw)
    weights = read_weights(directory)
    if layout == "speculators" and block is not None and block.get("embed_tokens") == "target":
        weights.pop(EMBED, None)  # the target's own, shipped for speculators' loader (``target_embedding``)
    if layout == "native":
        config = Eagle3Config.from_dict(block["architecture"])
    else:
        config = config_from_engine(raw, layout, target)
        # A checkpoint that carries an embedding keeps it: never drop weights silently.
        config.own_embedding = EMBED in weights
        if block is not None and block.get("architecture") != config.to_dict():
            raise CheckpointError(
                f"{directory}/config.json: its {layout} fields disagree with its spectrain block "
                "(edited by hand?); re-export it"
            )
    recorded = block.get("target") if block else None
    if recorded is not None and target is not None and not same_target(recorded, target):
        raise CheckpointError(
            f"{directory} was trained for target '{recorded.get('name')}', not "
            f"'{target.get('name')}'; use the target it was trained for"
        )
    ckpt = Eagle3Checkpoint(config, tensors_from_layout(weights, layout, config, directory), recorded or target, layout)
    if target is not None:
        check_against_target(config, target)
    return ckpt


def config_from_engine(raw: dict[str, Any], layout: str, target: dict[str, Any] | None) -> Eagle3Config:
    """The EAGLE-3 fields of an sglang or speculators ``config.json`` (a speculators one without
    ``norm_before_residual`` gets vLLM's EAGLE-3 default, True); ``target`` gives default aux layers."""
    if layout == "speculators":
        fields = dict(raw.get("transformer_layer_config") or {})
        if not fields:
            raise CheckpointError("speculators config has no transformer_layer_config")
        for flag in UNSUPPORTED_FLAGS:
            if raw.get(flag):
                raise CheckpointError(
                    f"speculators checkpoint sets {flag}=true (one norm over the concatenated aux "
                    "layers), which spectrain does not run; export it with fc_norm (a norm per "
                    "layer) or without that option"
                )
        norm_before_residual = raw.get("norm_before_residual", True)  # vLLM's default when absent
        output_ids = _from_vllm_ids(raw.get("eagle_aux_hidden_state_layer_ids"))
    else:
        fields = raw
        nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        top = _from_vllm_ids(raw.get("eagle_aux_hidden_state_layer_ids"))
        if nested is not None and top is not None and list(nested) != top:
            raise CheckpointError(
                f"config's eagle_config ids {list(nested)} (output-of-layer) and top-level ids "
                f"{raw['eagle_aux_hidden_state_layer_ids']} (vLLM input-of-layer) name different "
                "layers; fix one of them"
            )
        output_ids = list(nested) if nested is not None else top
        if (raw.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
            raise CheckpointError("eagle_config.use_aux_hidden_state=false is an EAGLE(-2) drafter, not EAGLE-3")
        norm_before_residual = False  # SGLang runs it this way whatever the config says
        for flag in EAGLE31_FLAGS:
            if raw.get(flag):
                raise CheckpointError(
                    f"sglang-layout config sets {flag}=true, a field that layout does not carry; "
                    "convert it to the speculators layout instead"
                )
        if raw.get("norm_before_residual"):
            raise CheckpointError(
                "sglang-layout config sets norm_before_residual=true, which SGLang ignores; "
                "convert it to the speculators layout instead"
            )
    if int(fields.get("num_hidden_layers", 1)) != 1:
        raise CheckpointError(
            f"EAGLE-3 drafter with {fields['num_hidden_layers']} decoder layers; spectrain runs "
            "one (num_hidden_layers=1)"
        )
    if output_ids is None:
        if target is None:
            raise CheckpointError(
                "checkpoint does not name its aux layers; give target=NAME_OR_DIR to use the "
                "EAGLE-3 default [1, L//2-1, L-4]"
            )
        output_ids = eagle3_layers(int(target["num_hidden_layers"]))
    theta, scaling = rope_of(fields)
    draft_vocab = raw.get("draft_vocab_size") or fields["vocab_size"]
    window = engine_window(fields) if layout == "speculators" else 0
    return Eagle3Config(
        hidden_size=fields["hidden_size"],
        intermediate_size=fields["intermediate_size"],
        num_attention_heads=fields["num_attention_heads"],
        num_key_value_heads=fields.get("num_key_value_heads") or fields["num_attention_heads"],
        head_dim=fields.get("head_dim"),
        vocab_size=fields["vocab_size"],
        draft_vocab_size=draft_vocab,
        target_hidden_size=raw.get("target_hidden_size") or fields["hidden_size"],
        aux_layer_ids=output_ids,
        rms_norm_eps=fields.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=fields.get("max_position_embeddings", 2048),
        hidden_act=fields.get("hidden_act", "silu"),
        norm_before_residual=bool(norm_before_residual),
        **{flag: True for flag in EAGLE31_FLAGS if layout == "speculators" and raw.get(flag)},
        attention_window=window,
    )


def engine_window(layer: dict[str, Any]) -> int:
    """The sliding window of a speculators ``transformer_layer_config`` (0: full attention). Its layer is sliding
    where ``layer_types`` says ``sliding_attention`` (the library's rule) and then needs ``sliding_window``."""
    types = layer.get("layer_types") or []
    if "sliding_attention" not in types:
        return 0
    if not layer.get("sliding_window"):
        raise CheckpointError(
            "speculators config marks its layer sliding_attention but gives no sliding_window; "
            "set transformer_layer_config.sliding_window to the window it was trained with"
        )
    return int(layer["sliding_window"])


def _from_vllm_ids(ids: list[int] | None) -> list[int] | None:
    return None if ids is None else [int(i) - 1 for i in ids]


def tensors_from_layout(
    weights: dict[str, torch.Tensor], layout: str, config: Eagle3Config, directory: Path
) -> dict[str, torch.Tensor]:
    """A layout's EAGLE-3 tensors under our names, strictly (nothing unknown or missing; ``t2d`` rebuilt from ``d2t``
    where an engine layout omits it), the vocabulary map checked."""
    prefix = LAYER_PREFIX[layout]
    names = expected_names(config, layout)
    if layout != "native" and "t2d" not in weights and "d2t" in weights:
        weights = {**weights, "t2d": _t2d_from_d2t(weights["d2t"], config.vocab_size)}  # engines never need it
    unknown, missing = sorted(set(weights) - names), sorted(names - set(weights))
    if set(FC_NORM_TENSORS) & set(missing if config.fc_norm else unknown):
        said, holds = ("sets fc_norm=true", "lack") if config.fc_norm else ("leaves fc_norm off", "hold")
        raise CheckpointError(
            f"{directory}: config.json {said} but the weights {holds} "
            f"{', '.join(FC_NORM_TENSORS)}; re-export the drafter with its config and weights "
            "together"
        )
    if unknown or missing:
        raise CheckpointError(
            f"{directory}: {layout} layout has unknown tensors {unknown[:4]} and lacks "
            f"{missing[:4]}; refusing to skip or invent weights"
        )
    tensors = {}
    for name, tensor in weights.items():
        if name.startswith(prefix):
            name = LAYER_PREFIX["native"] + name.removeprefix(prefix)
        tensors[name] = tensor
    _check_vocab(tensors, config, directory)
    return tensors


def _t2d_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[d2t.long() + torch.arange(d2t.numel())] = True
    return t2d


def _check_vocab(tensors: dict[str, torch.Tensor], config: Eagle3Config, where: Path) -> None:
    rows = tensors["lm_head.weight"].shape[0]
    if rows != config.draft_vocab_size or tensors["d2t"].numel() != rows:
        raise CheckpointError(
            f"{where}: draft_vocab_size {config.draft_vocab_size}, lm_head rows {rows} and d2t "
            f"length {tensors['d2t'].numel()} must all be equal"
        )
    if tensors["t2d"].numel() != config.vocab_size:
        raise CheckpointError(
            f"{where}: t2d covers {tensors['t2d'].numel()} ids but vocab_size is "
            f"{config.vocab_size} (vocab_size must be the TARGET vocabulary)"
        )
    try:
        check_vocab_mapping(tensors["d2t"].long(), tensors["t2d"].bool())
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    tensors["d2t"], tensors["t2d"] = tensors["d2t"].long(), tensors["t2d"].bool()


# ----------------------------------------------------------------------------------------------------------
# Targets


def layout_of(path: str | Path) -> str | None:
    """The EAGLE-3 layout of the directory ``path`` (None: no readable config.json of an EAGLE-3 checkpoint)."""
    raw = config_or_none(path)
    if raw is None:
        return None
    if "speculators_model_type" in raw:
        return "speculators" if raw["speculators_model_type"] == "eagle3" else None
    if any(a in SGLANG_ARCHITECTURES for a in raw.get("architectures") or []):
        return "sglang"
    block = raw.get("spectrain")
    return "native" if isinstance(block, dict) and block.get("kind") == "eagle3" else None
