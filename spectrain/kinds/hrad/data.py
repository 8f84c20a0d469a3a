"""H-RAD's DataModule: the usable rounds split by prompt into training and validation, class weights or a
class-balanced sampler, and the per-feature standardisation measured on the training split."""

from __future__ import annotations

import json
import math
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, WeightedRandomSampler

from core.distributed import process_rank
from core.drafters.hrad import (
    CLASS_NAMES,
    NUM_CLASSES,
    HRADError,
    check_boundaries,
    default_boundaries,
    embedding_probe,
)
from core.overrides import RecipeError
from data_prep.datamodules import resumable_loader
from spectrain.kinds.hrad.traces import last_k_of, load_trace_rows, read_input_embeddings, read_traces_manifest


class HRADRows(Dataset):
    """(hidden_lastk [K, d], branch-token embedding [d] float32, first-continuation confidence [] float32, label)
    per round."""

    def __init__(
        self, hidden: torch.Tensor, emb: torch.Tensor, labels: torch.Tensor, confidence: torch.Tensor | None = None
    ):
        self.hidden, self.emb, self.labels = hidden, emb, labels
        self.confidence = confidence if confidence is not None else torch.full((len(labels),), math.nan)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.hidden[i], self.emb[i], self.confidence[i], self.labels[i]


def split_prompts(prompts: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """Boolean mask of validation rows: a seeded ``fraction`` of the distinct prompts (at least one)."""
    unique = prompts.unique()
    if len(unique) < 2:
        raise HRADError(
            f"the traces hold {len(unique)} prompt(s): need >= 2 to hold some out, or give data.val_dataset_dir"
        )
    order = unique[torch.randperm(len(unique), generator=torch.Generator().manual_seed(seed))]
    n_val = min(len(unique) - 1, max(1, round(fraction * len(unique))))
    return torch.isin(prompts, order[:n_val])


def class_weights(labels: torch.Tensor) -> torch.Tensor:
    """n / (C · count_c): every class carries the same total weight (absent classes count as 1)."""
    counts = torch.bincount(labels, minlength=NUM_CLASSES).float()
    return len(labels) / (NUM_CLASSES * counts.clamp(min=1.0))


def feature_stats(
    hidden: torch.Tensor, emb: torch.Tensor, confidence: torch.Tensor | None = None, chunk: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-feature mean and std of z = [hidden flattened ; emb (; confidence)] over the rows, in float64 chunks."""
    extra = [] if confidence is None else [confidence.reshape(-1, 1)]
    total = torch.zeros(hidden[0].numel() + emb.shape[1] + len(extra), dtype=torch.float64)
    squares = torch.zeros_like(total)
    for start in range(0, len(hidden), chunk):
        z = torch.cat(
            [hidden[start : start + chunk].flatten(1), emb[start : start + chunk]]
            + [e[start : start + chunk] for e in extra],
            dim=1,
        ).double()
        total += z.sum(0)
        squares += (z * z).sum(0)
    n = max(len(hidden), 1)
    mean = total / n
    std = (squares / n - mean * mean).clamp(min=0).sqrt()
    return mean.float(), std.clamp(min=1e-5).float()


class HRADDataModule(L.LightningDataModule):
    """Train/val rows from traces, class statistics and the target record the export needs."""

    def __init__(self, cfg: Any):
        super().__init__()
        self.cfg = cfg
        self.train_set: HRADRows | None = None
        self.val_set: HRADRows | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        cfg, data = self.cfg, self.cfg.data
        last_k = last_k_of(data.layers)
        manifest = read_traces_manifest(data.dataset_dir, cfg.target, last_k)
        gamma = int(manifest["args"]["gamma"])
        self.boundaries = check_boundaries(cfg.model.boundaries or default_boundaries(gamma), gamma)
        rows = load_trace_rows(data.dataset_dir, manifest, self.boundaries, last_k)
        embeddings = read_input_embeddings(cfg.target)
        if data.val_dataset_dir:
            val_manifest = read_traces_manifest(data.val_dataset_dir, cfg.target, last_k)
            if int(val_manifest["args"]["gamma"]) != gamma:
                raise HRADError(
                    f"data.val_dataset_dir has gamma={val_manifest['args']['gamma']}, the training "
                    f"traces gamma={gamma}: record both with the same gamma"
                )
            train, val = rows, load_trace_rows(data.val_dataset_dir, val_manifest, self.boundaries, last_k)
            train_rows = (train.hidden, train.tokens, train.labels, train.confidence)
            val_rows = (val.hidden, val.tokens, val.labels, val.confidence)
        else:
            held_out = split_prompts(rows.prompts, cfg.model.val_fraction, cfg.seed)
            train_rows = (
                rows.hidden[~held_out],
                rows.tokens[~held_out],
                rows.labels[~held_out],
                rows.confidence[~held_out],
            )
            val_rows = (rows.hidden[held_out], rows.tokens[held_out], rows.labels[held_out], rows.confidence[held_out])
        use_confidence = bool(cfg.model.confidence_feature)
        if use_confidence and (bool(train_rows[3].isnan().any()) or bool(val_rows[3].isnan().any())):
            raise HRADError(
                f"{data.dataset_dir}: model.confidence_feature needs draft_max_probs[1] in every row "
                "(traces recorded with gamma >= 2)"
            )
        if len(train_rows[2]) == 0 or len(val_rows[2]) == 0:
            raise HRADError(
                f"{data.dataset_dir}: no usable rounds in the train or val split ({rows.dropped_rejected} "
                "rejected at the branch token); record more prompts"
            )

        def build(hidden, tokens, labels, confidence) -> HRADRows:
            return HRADRows(hidden, embeddings[tokens].float(), labels, confidence)

        self.train_set, self.val_set = build(*train_rows), build(*val_rows)
        self.gamma = gamma
        self.class_counts = {
            "train": torch.bincount(train_rows[2], minlength=NUM_CLASSES).tolist(),
            "val": torch.bincount(val_rows[2], minlength=NUM_CLASSES).tolist(),
        }
        self.class_weights = class_weights(train_rows[2])
        self.feature_mean, self.feature_std = feature_stats(
            self.train_set.hidden, self.train_set.emb, self.train_set.confidence if use_confidence else None
        )
        self.target_record = {**manifest["target"], "embed_probe": embedding_probe(embeddings).tolist()}
        self.summary = {
            "rounds": int(manifest["num_rows"]),
            "dropped_rejected": rows.dropped_rejected,
            "dropped_truncated": rows.dropped_truncated,
            "gamma": gamma,
            "boundaries": self.boundaries,
            "positions": manifest["args"].get("positions", "sps"),
            "confidence_feature": use_confidence,
            "confidence_path": str(cfg.model.confidence_path),
            "class_counts": self.class_counts,
        }
        print(f"[hrad] traces {data.dataset_dir}: {json.dumps(self.summary)}")
        for name, count in zip(CLASS_NAMES, self.class_counts["train"]):
            if count == 0:  # trainable, but that class will never be predicted
                print(
                    f"[hrad] warning: no training round has class '{name}' with boundaries {self.boundaries} "
                    f"(gamma={gamma}); a weak drafter rarely gets all continuation tokens accepted: set "
                    "model.boundaries (e.g. [1,2]) or record traces with a better drafter"
                )

    def train_dataloader(self) -> DataLoader:
        self.setup()
        if self.cfg.model.balance == "sampler":  # each class drawn equally often (with replacement)
            if process_rank()[1] > 1:  # the weighted draws are not split across processes
                raise RecipeError(
                    "model.balance=sampler trains on one process; use model.balance=weights "
                    "(or none) with trainer.devices > 1"
                )
            generator = torch.Generator().manual_seed(self.cfg.seed)
            labels = self.train_set.labels
            weights = (1.0 / torch.bincount(labels, minlength=NUM_CLASSES).float().clamp(min=1.0))[labels]
            sampler = WeightedRandomSampler(weights.double(), len(labels), replacement=True, generator=generator)
            return DataLoader(
                self.train_set,
                batch_size=self.cfg.data.batch_size,
                sampler=sampler,
                num_workers=self.cfg.data.num_workers,
            )
        # Stateful (exact mid-epoch resume) and split across processes; same first-epoch order as a plain
        # DataLoader(shuffle=True, generator=manual_seed(seed)).
        return resumable_loader(
            self.train_set,
            batch_size=self.cfg.data.batch_size,
            shuffle=True,
            seed=self.cfg.seed,
            num_workers=self.cfg.data.num_workers,
            per_rank=True,
        )

    def val_dataloader(self) -> DataLoader:
        self.setup()
        return DataLoader(
            self.val_set,
            batch_size=max(self.cfg.data.batch_size, 256),
            shuffle=False,
            num_workers=self.cfg.data.num_workers,
        )
