"""H-RAD's training data as ``data_prep.traces`` recorded it: the manifest checked against the recipe, the
usable rounds (hidden states, branch tokens, labels, prompts, the draft's confidence) and the target's input
embeddings, read alone from its weights."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from core.assets import model_identity, resolve_model_dir
from core.drafters.hrad import HRADError, hrad_labels
from core.layer_ids import LAYER_CONVENTION
from core.overrides import RecipeError
from data_prep.manifest import DatasetError, read_manifest
from data_prep.shards import ShardReader, to_tensor

_LAST_K = re.compile(r"^last(\d+)$")


def last_k_of(layers: Any) -> int:
    """K from the recipe's ``data.layers`` (H-RAD reads ``lastK``, SpecBranch uses last4)."""
    match = _LAST_K.match(str(layers))
    if not match:
        raise RecipeError(
            f"data.layers={layers} but H-RAD reads the last K hidden_states entries: set data.layers=last4 (or lastK)"
        )
    return int(match.group(1))


def read_traces_manifest(directory: Any, target: str | None, last_k: int) -> dict[str, Any]:
    """The manifest of a complete traces directory made for ``target`` with ``last{K}``, or a one-line
    ``DatasetError``."""
    if not directory:
        raise DatasetError(
            "data.dataset_dir is not set: give a traces directory (python -m data_prep.traces "
            "target=... drafter=... gamma=7 out=DIR)"
        )
    manifest = read_manifest(directory)
    if manifest.get("kind") != "traces":
        raise DatasetError(
            f"{directory} holds {manifest.get('kind')}, not acceptance traces (python -m data_prep.traces makes those)"
        )
    if not manifest["complete"]:
        raise DatasetError(
            f"{directory} is incomplete ({manifest['num_rows']} rounds so far): re-run its "
            "data_prep.traces command to finish it"
        )
    layers = manifest["layers"]
    if layers["convention"] != LAYER_CONVENTION or not layers.get("plus_final_norm"):
        raise DatasetError(f"{directory} names layers as '{layers['convention']}': re-record the traces")
    if layers["spec"] != f"last{last_k}":
        raise DatasetError(
            f"{directory} holds {layers['spec']} hidden states, the recipe reads last{last_k}: "
            f"re-record with last_k={last_k} or set data.layers={layers['spec']}"
        )
    if target is not None:
        have, want = manifest["target"], model_identity(str(target))
        if (have["config_hash"], have["weights_hash"]) != (want["config_hash"], want["weights_hash"]):
            raise DatasetError(
                f"{directory} was recorded with target '{have['name']}' (weights "
                f"{have['weights_hash']}), not '{target}' (weights {want['weights_hash']}): "
                f"record traces with target={target}"
            )
    return manifest


def read_input_embeddings(target: str) -> torch.Tensor:
    """The target's input embedding matrix [V, d], read alone from its safetensors (no model is built)."""
    from safetensors import safe_open  # safetensors: a heavy import, deferred to first use

    directory = resolve_model_dir(target)
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                if key.endswith("embed_tokens.weight"):
                    return handle.get_tensor(key)
    raise HRADError(
        f"no '*embed_tokens.weight' tensor in {directory}/*.safetensors: H-RAD needs the target's "
        "input embeddings (a Llama-family checkpoint in safetensors)"
    )


@dataclass
class TraceRows:
    """Usable rounds of a traces directory: hidden [n, K, d] (stored dtype), branch tokens, labels, prompts, and the
    draft's confidence at the first continuation token (float32)."""

    hidden: torch.Tensor
    tokens: torch.Tensor
    labels: torch.Tensor
    prompts: torch.Tensor
    dropped_rejected: int
    dropped_truncated: int
    confidence: torch.Tensor


def first_continuation_confidence(reader) -> torch.Tensor:
    """``draft_max_probs[1]`` per row (NaN for a one-token draft): the draft's confidence at the first
    continuation token, the distribution after the branch token."""
    values = [float(row[1]) if len(row) > 1 else math.nan for row in reader.column_arrays("draft_max_probs")]
    return torch.tensor(values, dtype=torch.float32)


def _numpy_column(reader, name: str):
    spec = reader.columns[name]
    parts = []
    for table in reader.tables:
        for chunk in table.column(name).chunks:
            if spec["shape"]:
                parts.append(chunk.flatten().to_numpy(zero_copy_only=False).reshape(len(chunk), -1))
            else:
                parts.append(chunk.to_numpy(zero_copy_only=False))
    return np.concatenate(parts) if parts else np.zeros((0,))


def load_trace_rows(directory: Any, manifest: dict[str, Any], boundaries: list[int], last_k: int) -> TraceRows:
    """Read the columns H-RAD uses into memory (hidden states stay in their stored dtype)."""
    reader = ShardReader(directory, manifest)
    gamma, hidden_size = int(manifest["args"]["gamma"]), int(manifest["target"]["hidden_size"])
    accepted = torch.from_numpy(_numpy_column(reader, "num_accepted")).long()
    draft_len = torch.from_numpy(_numpy_column(reader, "draft_len")).long()
    rejected = accepted == 0
    truncated = (draft_len < gamma) & ~rejected
    keep = ~rejected & ~truncated
    hidden = to_tensor(_numpy_column(reader, "hidden_lastk"), reader.columns["hidden_lastk"])[keep.numpy()]
    return TraceRows(
        hidden=hidden.view(-1, last_k, hidden_size),
        tokens=torch.from_numpy(_numpy_column(reader, "branch_token")).long()[keep],
        labels=hrad_labels(accepted[keep], boundaries),
        prompts=torch.from_numpy(_numpy_column(reader, "sample_index")).long()[keep],
        dropped_rejected=int(rejected.sum()),
        dropped_truncated=int(truncated.sum()),
        confidence=first_continuation_confidence(reader)[keep],
    )
