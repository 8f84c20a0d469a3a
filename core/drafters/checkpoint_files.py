"""What reading and writing any drafter's checkpoint directory shares, whatever its kind and layout: the one-line
error, the config.json probe and reader, the weights reader, the spectrain block's kind check, the checks against
the target a checkpoint was trained for, and the speculators/vLLM conventions several kinds' layouts use."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from core.assets import AssetError, load_safetensors, portable_model_reference, read_json
from core.drafters.native_export import REEXPORT
from core.errors import UserError


class CheckpointError(UserError):
    """A drafter checkpoint that cannot be read or written faithfully; the message is one line."""


def vllm_layer_ids(output_ids: list[int]) -> list[int]:
    """Output-of-layer ids -> vLLM's input-of-layer ids (the same tensors)."""
    return [i + 1 for i in output_ids]


def verifier_reference(target: dict[str, Any]) -> str:
    """The target of a record as speculators/vLLM can resolve it; a record without a name is refused."""
    if not target.get("name"):
        raise CheckpointError(
            "the target record has no name: give verifier=PATH_OR_ID (the target's local HF "
            "directory or hub id) for the speculators layout"
        )
    try:
        return portable_model_reference(target["name"])
    except AssetError as exc:
        raise CheckpointError(f"{exc}; give verifier=PATH_OR_ID") from None


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """``model.safetensors`` (or the ``pytorch_model.bin`` some hub drafters ship); a damaged file, or one with
    NaN/inf weights, is refused in one line."""
    fix = "re-export the drafter (python -m spectrain.export)"
    try:
        if (directory / "model.safetensors").is_file():
            return load_safetensors(directory / "model.safetensors", fix=fix)
    except AssetError as exc:
        raise CheckpointError(str(exc)) from None
    if (directory / "pytorch_model.bin").is_file():
        try:
            return torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as exc:  # a torn zip or pickle raises any of several types
            raise CheckpointError(
                f"{directory}/pytorch_model.bin is damaged ({str(exc).splitlines()[0]}); re-download the drafter"
            ) from None
    raise CheckpointError(f"{directory} has no model.safetensors or pytorch_model.bin")


def config_or_none(path: str | Path) -> dict[str, Any] | None:
    """The object in ``path``/config.json; None when there is none, or it is unreadable or not an object (a layout
    probe answers "not this kind" rather than raising)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        raw = json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return raw if isinstance(raw, dict) else None


def read_config(directory: Path, title: str) -> dict[str, Any]:
    """``directory``/config.json of a ``title`` checkpoint (e.g. "DFlash"), refused in one line when absent or
    unreadable."""
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory} has no config.json: not a {title} checkpoint directory")
    try:
        return read_json(directory / "config.json", fix=REEXPORT)
    except AssetError as exc:
        raise CheckpointError(str(exc)) from None


def checked_block(raw: dict[str, Any], directory: Path, kind: str, title: str) -> dict[str, Any] | None:
    """The ``spectrain`` block of ``raw`` (None for a foreign checkpoint); one recording another kind than ``kind``
    is an export contradicting itself, refused."""
    block = raw.get("spectrain") if isinstance(raw.get("spectrain"), dict) else None
    if block is not None and block.get("kind") != kind:
        raise CheckpointError(
            f"{directory}/config.json records a '{block.get('kind')}' drafter in a {title} layout; {REEXPORT}"
        )
    return block


def check_trained_for(directory: Path, recorded: dict[str, Any] | None, config: Any, target: dict[str, Any]) -> None:
    """Refuse a checkpoint whose ``recorded`` target is not ``target``, or whose ``config`` does not fit it."""
    if recorded is not None and not same_target(recorded, target):
        raise CheckpointError(
            f"{directory} was trained for target '{recorded.get('name')}', not "
            f"'{target.get('name')}'; use the target it was trained for"
        )
    check_against_target(config, target)


def same_target(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a.get("config_hash"), a.get("weights_hash")) == (b.get("config_hash"), b.get("weights_hash"))


def check_against_target(config: Any, target: dict[str, Any]) -> None:
    """Refuse a drafter whose shapes do not fit ``target`` (a target record) with a one-line reason."""
    name = target.get("name")
    if config.vocab_size != target["vocab_size"]:
        raise CheckpointError(
            f"drafter vocab_size {config.vocab_size} differs from target '{name}' vocab "
            f"{target['vocab_size']}: it was trained for another tokenizer"
        )
    if config.target_hidden_size != target["hidden_size"]:
        raise CheckpointError(
            f"drafter reads target features of width {config.target_hidden_size} but target "
            f"'{name}' has hidden_size {target['hidden_size']}"
        )
    if max(config.aux_layer_ids) >= target["num_hidden_layers"]:
        raise CheckpointError(
            f"drafter aux layers {config.aux_layer_ids} do not exist in target '{name}' "
            f"({target['num_hidden_layers']} layers)"
        )
