"""The training side of feature datasets: memory-mapped loading, the identity check, and batch collation.

Batch format (``collate_features``; the one place where samples are padded), a dict of tensors:

- ``input_ids``      [B, T] int64, right-padded with 0
- ``loss_mask``      [B, T] int64, 1 on assistant tokens, 0 elsewhere and on padding
- ``attention_mask`` [B, T] int64, 1 on real tokens, 0 on padding
- ``aux_hidden``     [B, T, k*H] storage dtype, aux layers concatenated in increasing id order
  (``manifest["layers"]["ids"]``; block j is the output of decoder layer ids[j]), zero on padding
- ``last_hidden``    [B, T, H] storage dtype, after the target's final norm, zero on padding

An fp8 dataset (``dtype=fp8``) reads as bf16: ``FeatureDataset`` multiplies each column's codes by the scales the
column spec names and drops the scale columns, so its batches have the keys, shapes and dtype of a bf16 dataset's
(the products are exact in bf16: ``data_prep.fp8``).

Positions are NOT shifted: row t holds token t and the target's features at t. The EAGLE shift
(docs/algorithms/eagle3.md §1) is the training recipe's business.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from core.assets import model_identity
from core.layer_ids import LAYER_CONVENTION, resolve_layers
from data_prep.fp8 import dequantize
from data_prep.manifest import DatasetError, read_manifest, tokenizer_identity
from data_prep.shards import ShardReader, to_tensor

DEQUANTIZED_DTYPE = torch.bfloat16  # what fp8 features read as: exact, and what a bf16 dataset yields


def collate_features(samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad every per-sample tensor along its token axis (dim 0) with zeros; add ``attention_mask``."""
    lengths = [len(s["input_ids"]) for s in samples]
    width = max(lengths)
    batch: dict[str, torch.Tensor] = {}
    for key in samples[0]:
        first = samples[0][key]
        out = first.new_zeros((len(samples), width, *first.shape[1:]))
        for row, sample in enumerate(samples):
            out[row, : lengths[row]] = sample[key]
        batch[key] = out
    mask = torch.zeros(len(samples), width, dtype=torch.long, device=samples[0]["input_ids"].device)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    batch["attention_mask"] = mask
    return batch


def check_features(
    dataset: str | Path | dict[str, Any],
    *,
    target: str | None = None,
    layers: Any = None,
    tokenizer=None,
    dtype: str | None = None,
    max_len: int | None = None,
    allow_incomplete: bool = False,
) -> dict[str, Any]:
    """Refuse (``DatasetError``, one line) a feature dataset that does not match what training expects.

    ``target``: a target name/dir, compared by config hash and weights hash; ``layers``: a layer spec
    (eagle3 | lastK | ids), resolved for the dataset's target; ``tokenizer``: compared by vocabulary and chat
    template hashes; ``dtype``: bf16 | fp16 | fp32 | fp8 (storage); ``max_len``: the dataset's max_len must not be
    smaller.
    Returns the manifest.
    """
    manifest = dataset if isinstance(dataset, dict) else read_manifest(dataset)
    where = manifest.get("args", {}).get("out", "the dataset") if isinstance(dataset, dict) else str(dataset)
    if manifest.get("kind") != "features":
        raise DatasetError(
            f"{where} holds {manifest.get('kind')}, not hidden-state features (python -m data_prep.extract makes those)"
        )
    if not manifest["complete"] and not allow_incomplete:
        raise DatasetError(
            f"{where} is incomplete ({manifest['num_rows']} samples so far): re-run its extract command to finish it"
        )
    have = manifest["target"]
    if target is not None:
        want = model_identity(str(target))
        if (have["config_hash"], have["weights_hash"]) != (want["config_hash"], want["weights_hash"]):
            raise DatasetError(
                f"{where} was extracted from target '{have['name']}' (config {have['config_hash']}, "
                f"weights {have['weights_hash']}), not '{target}' (config {want['config_hash']}, "
                f"weights {want['weights_hash']}): re-extract with target={target}"
            )
    stored = manifest["layers"]
    if stored["convention"] != LAYER_CONVENTION:
        raise DatasetError(
            f"{where} names layers as '{stored['convention']}', this spectrain uses '{LAYER_CONVENTION}': re-extract"
        )
    if layers is not None:
        wanted = resolve_layers(layers, have["num_layers"])
        if wanted != stored["ids"]:
            raise DatasetError(
                f"{where} holds layers {stored['ids']} ({stored['spec']}), the recipe wants "
                f"{wanted} ({layers}): re-extract with layers={layers}"
            )
    if tokenizer is not None:
        want_tok = tokenizer_identity(tokenizer)
        for key, what in (("vocab_hash", "vocabulary"), ("chat_template_hash", "chat template")):
            if manifest["tokenizer"][key] != want_tok[key]:
                raise DatasetError(
                    f"{where} was tokenized with another {what} ({key} "
                    f"{manifest['tokenizer'][key]} != {want_tok[key]}): re-extract with this "
                    "target's tokenizer"
                )
    if dtype is not None and manifest["args"]["dtype"] != dtype:
        raise DatasetError(
            f"{where} stores {manifest['args']['dtype']} features, the recipe wants {dtype}: "
            f"re-extract with dtype={dtype} or set the recipe's dtype"
        )
    if max_len is not None and manifest["args"]["max_len"] < max_len:
        raise DatasetError(
            f"{where} was cut at max_len={manifest['args']['max_len']} < the recipe's {max_len}: "
            f"re-extract with max_len={max_len}"
        )
    return manifest


class FeatureDataset(Dataset):
    """A feature directory's samples, memory-mapped; ``ds[i]`` is a dict of per-sample tensors (see
    ``data_prep.capture``). Checks the manifest (``check_features`` keywords) and the shards on open:
    a missing, truncated or unreadable shard is refused by name (``checksums=True`` also compares sha256)."""

    def __init__(self, directory: str | Path, *, checksums: bool = False, **expect: Any):
        self.directory = Path(directory)
        self.manifest = check_features(self.directory, **expect)
        self.reader: ShardReader | None = ShardReader(self.directory, self.manifest, checksums=checksums)
        self.columns = self.manifest["columns"]
        self._len = len(self.reader)

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers get the path, not the mapped tables (pickling those would copy every shard).
        return {**self.__dict__, "reader": None}

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self.reader is None:  # unpickled in a DataLoader worker: map the shards again
            self.reader = ShardReader(self.directory, self.manifest)
        row = self.reader.row(index)
        sample = {name: to_tensor(value, self.columns[name]) for name, value in row.items()}
        for name, spec in self.columns.items():
            if "scale" in spec:  # fp8 codes: dequantized here, the scale column dropped
                sample[name] = dequantize(sample[name], sample.pop(spec["scale"]), DEQUANTIZED_DTYPE)
        # Token columns are stored narrow (int32 / int8); training code indexes with int64.
        sample["input_ids"] = sample["input_ids"].long()
        sample["loss_mask"] = sample["loss_mask"].long()
        return sample

    @property
    def layer_ids(self) -> list[int]:
        return list(self.manifest["layers"]["ids"])
