"""``kind=hrad``: train SpecBranch's H-RAD classifier on acceptance traces (recipes ``hrad_smollm2``,
``hrad_llama8b``); the model and its export: :mod:`core.drafters.hrad`.

Data: a ``data_prep.traces`` directory (``data.dataset_dir``). A row is a verification round (``positions=sps``)
or a surviving SpecBranch branch (``positions=specbranch``: where serving asks H-RAD); H-RAD's input is [the row's
``hidden_lastk`` ; the target's input embedding of its ``branch_token``] (+ with ``model.confidence_feature`` the
draft's confidence at the first continuation token, ``draft_max_probs[1]``, entering as one more MLP input or,
with ``model.confidence_path=logit``, through its own linear path to the logits), its label comes from
``num_accepted`` with ``model.boundaries`` (default ``[1, γ-1]``). Rounds whose branch token was rejected (no
surviving branch) and rounds cut short by the token budget (``draft_len < γ``: "all accepted" is unknowable)
are left out. Validation: ``data.val_dataset_dir``, or held-out prompts (``model.val_fraction``) of the same
traces, so no prompt is in both splits.

Training: cross-entropy with class weights n / (C·count_c) (``model.balance=weights``) or a class-balanced
sampler (``sampler``); per-feature standardisation measured on the training split. After every validation and
at the end of training a temperature is fitted on the validation logits (LBFGS on the NLL, never worse than
T=1) and stored in the model. With ``model.confidence_path=logit`` the end of training first refits the late fusion
on the validation rows (:func:`fit_late_fusion`: the MLP's weight α and the confidence path, class-weighted like
training), then the temperature. Logged: ``train/loss``, ``train/recall_<class>``, ``train/ece``; ``val/nll``,
``val/nll_calibrated``, ``val/ece_raw``, ``val/ece`` (calibrated), ``val/recall_<class>``,
``val/balanced_accuracy``, ``val/accuracy``, ``val/temperature``, ``val/confusion_<true>_<pred>``. At the end
of training ``confusion_matrix.png`` and ``hrad_metrics.json`` are written next to the checkpoints and
``last.ckpt`` is re-saved with the final calibration (export that one).
"""

from __future__ import annotations

import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, Dataset, WeightedRandomSampler

from core.assets import AssetError, model_identity, resolve_model_dir
from core.drafters.eagle3_layouts import CheckpointError
from core.drafters.hrad import (CLASS_NAMES, DEFAULT_EPSILON, HRAD, NUM_CLASSES, HRADConfig, HRADError,
                                check_boundaries, default_boundaries, embedding_probe, hrad_labels,
                                save_native)
from core.distributed import process_mean, process_rank
from core.layer_ids import LAYER_CONVENTION
from core.overrides import OverrideError, RecipeError
from data_prep.datamodules import resumable_loader
from data_prep.manifest import DatasetError, read_manifest
from data_prep.shards import ShardReader, to_tensor
from spectrain.export import read_lightning_checkpoint
from spectrain.modules.base import DrafterModule
from spectrain.registry import DrafterKind, register_kind

BALANCE = ("weights", "sampler", "none")
_LAST_K = re.compile(r"^last(\d+)$")


@dataclass
class HRADSchema:
    mlp_hidden: list[int] = field(default_factory=lambda: [256, 64])
    dropout: float = 0.2
    boundaries: list[int] | None = None  # accepted continuation tokens starting classes 1 and 2; None = [1, γ-1]
    epsilon: float = DEFAULT_EPSILON  # class 1's draft-confidence threshold, stored in the export
    # also read the draft's confidence at the first continuation token (draft_max_probs[1] of a trace row)
    confidence_feature: bool = False
    # where it enters: input (one more MLP input) | logit (its own Linear(1→3) added to the MLP's logits)
    confidence_path: str = "input"
    balance: str = "weights"  # weights (class-weighted loss) | sampler (class-balanced sampling) | none
    val_fraction: float = 0.2  # prompts held out for validation when data.val_dataset_dir is not given
    ece_bins: int = 10


# ------------------------------------------------------------------------------------------------ data


def _recipe_error(message: str) -> Exception:
    return RecipeError(message)


def last_k_of(layers: Any) -> int:
    """K from the recipe's ``data.layers`` (H-RAD reads ``lastK``, SpecBranch uses last4)."""
    match = _LAST_K.match(str(layers))
    if not match:
        raise _recipe_error(f"data.layers={layers} but H-RAD reads the last K hidden_states entries: set "
                            "data.layers=last4 (or lastK)")
    return int(match.group(1))


def read_traces_manifest(directory: Any, target: str | None, last_k: int) -> dict[str, Any]:
    """The manifest of a complete traces directory made for ``target`` with ``last{K}``, or a one-line
    ``DatasetError``."""
    if not directory:
        raise DatasetError("data.dataset_dir is not set: give a traces directory (python -m data_prep.traces "
                           "target=... drafter=... gamma=7 out=DIR)")
    manifest = read_manifest(directory)
    if manifest.get("kind") != "traces":
        raise DatasetError(f"{directory} holds {manifest.get('kind')}, not acceptance traces (python -m "
                           "data_prep.traces makes those)")
    if not manifest["complete"]:
        raise DatasetError(f"{directory} is incomplete ({manifest['num_rows']} rounds so far): re-run its "
                           "data_prep.traces command to finish it")
    layers = manifest["layers"]
    if layers["convention"] != LAYER_CONVENTION or not layers.get("plus_final_norm"):
        raise DatasetError(f"{directory} names layers as '{layers['convention']}': re-record the traces")
    if layers["spec"] != f"last{last_k}":
        raise DatasetError(f"{directory} holds {layers['spec']} hidden states, the recipe reads last{last_k}: "
                           f"re-record with last_k={last_k} or set data.layers={layers['spec']}")
    if target is not None:
        have, want = manifest["target"], model_identity(str(target))
        if (have["config_hash"], have["weights_hash"]) != (want["config_hash"], want["weights_hash"]):
            raise DatasetError(f"{directory} was recorded with target '{have['name']}' (weights "
                               f"{have['weights_hash']}), not '{target}' (weights {want['weights_hash']}): "
                               f"record traces with target={target}")
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
    raise HRADError(f"no '*embed_tokens.weight' tensor in {directory}/*.safetensors: H-RAD needs the target's "
                    "input embeddings (a Llama-family checkpoint in safetensors)")


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
    return TraceRows(hidden=hidden.view(-1, last_k, hidden_size),
                     tokens=torch.from_numpy(_numpy_column(reader, "branch_token")).long()[keep],
                     labels=hrad_labels(accepted[keep], boundaries),
                     prompts=torch.from_numpy(_numpy_column(reader, "sample_index")).long()[keep],
                     dropped_rejected=int(rejected.sum()), dropped_truncated=int(truncated.sum()),
                     confidence=first_continuation_confidence(reader)[keep])


class HRADRows(Dataset):
    """(hidden_lastk [K, d], branch-token embedding [d] float32, first-continuation confidence [] float32, label)
    per round."""

    def __init__(self, hidden: torch.Tensor, emb: torch.Tensor, labels: torch.Tensor,
                 confidence: torch.Tensor | None = None):
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
        raise HRADError(f"the traces hold {len(unique)} prompt(s): need >= 2 to hold some out, or give "
                        "data.val_dataset_dir")
    order = unique[torch.randperm(len(unique), generator=torch.Generator().manual_seed(seed))]
    n_val = min(len(unique) - 1, max(1, round(fraction * len(unique))))
    return torch.isin(prompts, order[:n_val])


def class_weights(labels: torch.Tensor) -> torch.Tensor:
    """n / (C · count_c): every class carries the same total weight (absent classes count as 1)."""
    counts = torch.bincount(labels, minlength=NUM_CLASSES).float()
    return len(labels) / (NUM_CLASSES * counts.clamp(min=1.0))


def feature_stats(hidden: torch.Tensor, emb: torch.Tensor, confidence: torch.Tensor | None = None,
                  chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-feature mean and std of z = [hidden flattened ; emb (; confidence)] over the rows, in float64 chunks."""
    extra = [] if confidence is None else [confidence.reshape(-1, 1)]
    total = torch.zeros(hidden[0].numel() + emb.shape[1] + len(extra), dtype=torch.float64)
    squares = torch.zeros_like(total)
    for start in range(0, len(hidden), chunk):
        z = torch.cat([hidden[start:start + chunk].flatten(1), emb[start:start + chunk]]
                      + [e[start:start + chunk] for e in extra], dim=1).double()
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
                raise HRADError(f"data.val_dataset_dir has gamma={val_manifest['args']['gamma']}, the training "
                                f"traces gamma={gamma}: record both with the same gamma")
            train, val = rows, load_trace_rows(data.val_dataset_dir, val_manifest, self.boundaries, last_k)
            train_rows = (train.hidden, train.tokens, train.labels, train.confidence)
            val_rows = (val.hidden, val.tokens, val.labels, val.confidence)
        else:
            held_out = split_prompts(rows.prompts, cfg.model.val_fraction, cfg.seed)
            train_rows = (rows.hidden[~held_out], rows.tokens[~held_out], rows.labels[~held_out],
                          rows.confidence[~held_out])
            val_rows = (rows.hidden[held_out], rows.tokens[held_out], rows.labels[held_out], rows.confidence[held_out])
        use_confidence = bool(cfg.model.confidence_feature)
        if use_confidence and (bool(train_rows[3].isnan().any()) or bool(val_rows[3].isnan().any())):
            raise HRADError(f"{data.dataset_dir}: model.confidence_feature needs draft_max_probs[1] in every row "
                            "(traces recorded with gamma >= 2)")
        if len(train_rows[2]) == 0 or len(val_rows[2]) == 0:
            raise HRADError(f"{data.dataset_dir}: no usable rounds in the train or val split ({rows.dropped_rejected} "
                            "rejected at the branch token); record more prompts")

        def build(hidden, tokens, labels, confidence) -> HRADRows:
            return HRADRows(hidden, embeddings[tokens].float(), labels, confidence)

        self.train_set, self.val_set = build(*train_rows), build(*val_rows)
        self.gamma = gamma
        self.class_counts = {"train": torch.bincount(train_rows[2], minlength=NUM_CLASSES).tolist(),
                             "val": torch.bincount(val_rows[2], minlength=NUM_CLASSES).tolist()}
        self.class_weights = class_weights(train_rows[2])
        self.feature_mean, self.feature_std = feature_stats(
            self.train_set.hidden, self.train_set.emb, self.train_set.confidence if use_confidence else None)
        self.target_record = {**manifest["target"], "embed_probe": embedding_probe(embeddings).tolist()}
        self.summary = {"rounds": int(manifest["num_rows"]), "dropped_rejected": rows.dropped_rejected,
                        "dropped_truncated": rows.dropped_truncated, "gamma": gamma, "boundaries": self.boundaries,
                        "positions": manifest["args"].get("positions", "sps"), "confidence_feature": use_confidence,
                        "confidence_path": str(cfg.model.confidence_path),
                        "class_counts": self.class_counts}
        print(f"[hrad] traces {data.dataset_dir}: {json.dumps(self.summary)}")
        for name, count in zip(CLASS_NAMES, self.class_counts["train"]):
            if count == 0:  # trainable, but that class will never be predicted
                print(f"[hrad] warning: no training round has class '{name}' with boundaries {self.boundaries} "
                      f"(gamma={gamma}); a weak drafter rarely gets all continuation tokens accepted: set "
                      "model.boundaries (e.g. [1,2]) or record traces with a better drafter")

    def train_dataloader(self) -> DataLoader:
        self.setup()
        if self.cfg.model.balance == "sampler":  # each class drawn equally often (with replacement)
            if process_rank()[1] > 1:  # the weighted draws are not split across processes
                raise _recipe_error("model.balance=sampler trains on one process; use model.balance=weights "
                                    "(or none) with trainer.devices > 1")
            generator = torch.Generator().manual_seed(self.cfg.seed)
            labels = self.train_set.labels
            weights = (1.0 / torch.bincount(labels, minlength=NUM_CLASSES).float().clamp(min=1.0))[labels]
            sampler = WeightedRandomSampler(weights.double(), len(labels), replacement=True, generator=generator)
            return DataLoader(self.train_set, batch_size=self.cfg.data.batch_size, sampler=sampler,
                              num_workers=self.cfg.data.num_workers)
        # Stateful (exact mid-epoch resume) and split across processes; same first-epoch order as a plain
        # DataLoader(shuffle=True, generator=manual_seed(seed)).
        return resumable_loader(self.train_set, batch_size=self.cfg.data.batch_size, shuffle=True, seed=self.cfg.seed,
                                num_workers=self.cfg.data.num_workers, per_rank=True)

    def val_dataloader(self) -> DataLoader:
        self.setup()
        return DataLoader(self.val_set, batch_size=max(self.cfg.data.batch_size, 256), shuffle=False,
                          num_workers=self.cfg.data.num_workers)


# ------------------------------------------------------------------------------------------ calibration


def minimise_lbfgs(params: list[torch.Tensor], loss_fn, max_iter: int) -> None:
    """Minimise ``loss_fn()`` over ``params`` in place (LBFGS, strong-Wolfe line search): the small convex fits
    done after training (temperature, late fusion)."""
    optimizer = torch.optim.LBFGS(params, lr=0.5, max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = loss_fn()
        loss.backward()
        return loss

    optimizer.step(closure)


def fit_temperature(logits: torch.Tensor, labels: torch.Tensor, max_iter: int = 100) -> float:
    """The softmax temperature minimising the NLL of ``labels`` (LBFGS over log T); 1.0 if that is no better."""
    logits, labels = logits.detach().double(), labels.long()
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    minimise_lbfgs([log_t], lambda: F.cross_entropy(logits / log_t.exp(), labels), max_iter)
    temperature = float(log_t.detach().exp())
    if not math.isfinite(temperature):
        return 1.0
    with torch.no_grad():
        better = F.cross_entropy(logits / temperature, labels) <= F.cross_entropy(logits, labels)
    return temperature if better else 1.0


def fit_late_fusion(mlp_logits: torch.Tensor, confidence: torch.Tensor, labels: torch.Tensor,
                    weight: torch.Tensor | None = None, max_iter: int = 200) -> tuple[float, torch.Tensor, torch.Tensor]:
    """``confidence_path=logit``'s stacking step: (α >= 0, W [3, 1], b [3]) minimising the (class-weighted) NLL of
    ``labels`` under logits = α·``mlp_logits`` + W·``confidence`` + b on held-out rows (LBFGS; ``confidence`` [n, 1]
    standardised). The MLP gets only the weight those rows support: where its logits do not generalise, α -> 0
    and the model is a logistic regression on the confidence (the rule's ranking)."""
    mlp_logits, confidence, labels = mlp_logits.detach().double(), confidence.detach().double(), labels.long()
    weight = None if weight is None else weight.detach().double()

    def fit(free_alpha: bool) -> tuple[float, torch.Tensor, torch.Tensor, float]:
        alpha = torch.tensor(1.0 if free_alpha else 0.0, dtype=torch.float64, requires_grad=free_alpha)
        w = torch.zeros(NUM_CLASSES, 1, dtype=torch.float64, requires_grad=True)
        b = torch.zeros(NUM_CLASSES, dtype=torch.float64, requires_grad=True)
        params = [w, b] + ([alpha] if free_alpha else [])

        def loss_fn():
            return F.cross_entropy(alpha * mlp_logits + confidence @ w.T + b, labels, weight=weight)

        minimise_lbfgs(params, loss_fn, max_iter)
        with torch.no_grad():
            return float(alpha), w.detach(), b.detach(), float(loss_fn())

    alpha, w, b, loss = fit(True)
    if not (math.isfinite(loss) and alpha >= 0):  # a negative weight on the MLP is no model: confidence alone
        alpha, w, b, loss = fit(False)
    return alpha, w.float(), b.float()


def classification_metrics(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                           ece_bins: int = 10) -> dict[str, Any]:
    """Recall per class, confusion matrix (rows: true, columns: predicted), NLL and ECE raw and at
    ``temperature`` (argmax decisions do not depend on it)."""
    # torchmetrics: a heavy import, deferred to first use
    from torchmetrics.classification import (MulticlassCalibrationError, MulticlassConfusionMatrix,
                                             MulticlassRecall)

    logits, labels = logits.detach().float().cpu(), labels.long().cpu()
    recall = MulticlassRecall(num_classes=NUM_CLASSES, average=None)(logits, labels)
    confusion = MulticlassConfusionMatrix(num_classes=NUM_CLASSES)(logits, labels)
    ece = MulticlassCalibrationError(num_classes=NUM_CLASSES, n_bins=ece_bins, norm="l1")
    support = torch.bincount(labels, minlength=NUM_CLASSES)
    present = support > 0
    return {  # recall of a class without rows is undefined: None (not logged)
        "recall": {name: float(r) if n else None for name, r, n in zip(CLASS_NAMES, recall, support)},
        "support": {name: int(n) for name, n in zip(CLASS_NAMES, support)},
        "balanced_accuracy": float(recall[present].mean()) if present.any() else 0.0,
        "accuracy": float((logits.argmax(-1) == labels).float().mean()),
        "confusion": confusion.tolist(),
        "nll": float(F.cross_entropy(logits, labels)),
        "nll_calibrated": float(F.cross_entropy(logits / temperature, labels)),
        "ece_raw": float(ece(logits.softmax(-1), labels)),
        "ece": float(ece(F.softmax(logits / temperature, -1), labels)),
        "temperature": float(temperature),
        "count": len(labels),
    }


def confusion_png(confusion: list[list[int]], title: str = "H-RAD confusion (validation)") -> bytes:
    """The confusion matrix as a PNG (rows: true class, columns: predicted; counts and row-normalised %)."""

    import matplotlib  # matplotlib: a heavy import, deferred to first use

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: a heavy import, deferred to first use

    matrix = torch.tensor(confusion, dtype=torch.float64)
    rates = matrix / matrix.sum(1, keepdim=True).clamp(min=1)
    fig, ax = plt.subplots(figsize=(4.6, 4.0), dpi=100)
    ax.imshow(rates.numpy(), cmap="Blues", vmin=0, vmax=1)
    for i in range(NUM_CLASSES):
        for j in range(NUM_CLASSES):
            ax.text(j, i, f"{int(matrix[i, j])}\n{100 * rates[i, j]:.0f}%", ha="center", va="center",
                    color="white" if rates[i, j] > 0.6 else "black", fontsize=9)
    ax.set_xticks(range(NUM_CLASSES), CLASS_NAMES, fontsize=8)
    ax.set_yticks(range(NUM_CLASSES), CLASS_NAMES, fontsize=8)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata={"Software": None})  # no timestamp/version: same bytes per matrix
    plt.close(fig)
    return buffer.getvalue()


# ------------------------------------------------------------------------------------------ the module


class HRADModule(L.LightningModule):
    def __init__(self, cfg: Any):
        super().__init__()

        self.save_hyperparameters({"recipe": OmegaConf.to_container(cfg, resolve=True)})
        self.cfg = cfg
        model = cfg.model
        if model.balance not in BALANCE:
            raise _recipe_error(f"model.balance={model.balance} is not one of {', '.join(BALANCE)}")
        if not 0.0 < model.val_fraction < 1.0:
            raise _recipe_error(f"model.val_fraction={model.val_fraction} must be in (0, 1)")
        last_k = last_k_of(cfg.data.layers)
        try:  # every path and the traces' identity, before any work (the dry run stops after this)
            target_config = json.loads((resolve_model_dir(cfg.target) / "config.json").read_text())
            manifest = read_traces_manifest(cfg.data.dataset_dir, cfg.target, last_k)
            gamma = int(manifest["args"]["gamma"])
            config = HRADConfig(hidden_size=int((target_config.get("text_config") or target_config)["hidden_size"]),
                                last_k=last_k, mlp_hidden=list(model.mlp_hidden), dropout=model.dropout, gamma=gamma,
                                boundaries=check_boundaries(model.boundaries or default_boundaries(gamma), gamma),
                                epsilon=model.epsilon, confidence_feature=bool(model.confidence_feature),
                                confidence_path=str(model.confidence_path))
        except (AssetError, DatasetError, HRADError) as exc:
            raise _recipe_error(str(exc)) from None
        self.drafter = HRAD(config)
        self.register_buffer("class_weights", torch.ones(NUM_CLASSES))
        self.target_record: dict[str, Any] = {}
        self.data_summary: dict[str, Any] = {}
        self.final_metrics: dict[str, Any] = {}
        self._train_outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._val_outputs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def setup(self, stage: str) -> None:
        datamodule = self.trainer.datamodule
        datamodule.setup(stage)
        # Statistics of the training split; a resumed run restores the saved ones over these afterwards.
        self.drafter.feature_mean.copy_(datamodule.feature_mean)
        self.drafter.feature_std.copy_(datamodule.feature_std)
        self.class_weights.copy_(datamodule.class_weights)
        self.target_record = datamodule.target_record
        self.data_summary = datamodule.summary

    # DrafterModule's optimizer (AdamW + warm-up/cosine over self.drafter) and FSDP hooks, shared as they are.
    FSDP_FORWARD_METHODS: tuple[str, ...] = ()
    configure_optimizers = DrafterModule.configure_optimizers
    configure_model = DrafterModule.configure_model
    on_validation_start = DrafterModule.on_validation_start
    on_validation_end = DrafterModule.on_validation_end

    def _logits(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, emb, confidence, labels = batch
        return self.drafter(hidden, emb, confidence if self.drafter.config.confidence_feature else None), labels

    def training_step(self, batch, batch_idx):
        logits, labels = self._logits(batch)
        # Class-weighted mean over the global batch (F.cross_entropy's weighted mean, over every process's rows).
        weight = self.class_weights[labels] if self.cfg.model.balance == "weights" else torch.ones_like(labels,
                                                                                                     dtype=torch.float)
        loss = process_mean((F.cross_entropy(logits, labels, reduction="none") * weight).sum(), weight.sum())
        self.log("train/loss", loss, prog_bar=True, batch_size=len(labels))
        self._train_outputs.append((logits.detach().float().cpu(), labels.cpu()))
        return loss

    def on_train_epoch_end(self) -> None:
        if not self._train_outputs:
            return
        logits, labels = (torch.cat(x) for x in zip(*self._train_outputs))
        self._train_outputs.clear()
        report = classification_metrics(logits, labels, ece_bins=self.cfg.model.ece_bins)
        for name, value in report["recall"].items():
            if value is not None:
                self.log(f"train/recall_{name}", value)
        self.log("train/ece", report["ece_raw"])
        self.log("train/balanced_accuracy", report["balanced_accuracy"])

    def validation_step(self, batch, batch_idx):
        logits, labels = self._logits(batch)
        self._val_outputs.append((logits.float().cpu(), labels.cpu()))

    def on_validation_epoch_end(self) -> None:
        outputs, self._val_outputs = self._val_outputs, []
        if not outputs or self.trainer.sanity_checking:
            return
        report = self._calibrate(*(torch.cat(x) for x in zip(*outputs)))
        for key in ("nll", "nll_calibrated", "ece_raw", "ece", "balanced_accuracy", "accuracy", "temperature"):
            self.log(f"val/{key}", report[key], prog_bar=key in ("nll", "balanced_accuracy"))
        for name, value in report["recall"].items():
            if value is not None:
                self.log(f"val/recall_{name}", value)
        for i, row in enumerate(report["confusion"]):
            for j, count in enumerate(row):
                self.log(f"val/confusion_{i}_{j}", float(count))

    def _calibrate(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        """Fit the temperature on these validation logits, store it in the model, return the metrics."""
        temperature = fit_temperature(logits, labels)
        self.drafter.temperature.fill_(temperature)
        report = classification_metrics(logits, labels, temperature, self.cfg.model.ece_bins)
        self.final_metrics = report
        return report

    @torch.no_grad()
    def _refit_fusion(self) -> dict[str, Any]:
        """``confidence_path=logit``: the MLP's weight and the confidence path, fitted on the validation rows."""
        parts = []
        for batch in self.trainer.datamodule.val_dataloader():
            hidden, emb, confidence, labels = (t.to(self.device) for t in batch)
            mlp_logits, conf = self.drafter.fusion_inputs(self.drafter.features(hidden, emb, confidence))
            parts.append((mlp_logits.float().cpu(), conf.float().cpu(), labels.cpu()))
        mlp_logits, conf, labels = (torch.cat(x) for x in zip(*parts))
        weight = self.class_weights.cpu() if self.cfg.model.balance == "weights" else None
        alpha, w, b = fit_late_fusion(mlp_logits, conf, labels, weight)
        self.drafter.mlp_scale.fill_(alpha)
        self.drafter.confidence_logit.weight.copy_(w)
        self.drafter.confidence_logit.bias.copy_(b)
        return {"mlp_scale": alpha, "confidence_weight": w.squeeze(1).tolist(), "confidence_bias": b.tolist()}

    @torch.no_grad()
    def on_train_end(self) -> None:
        """Final calibration on the whole validation split (with confidence_path=logit: the late fusion's refit
        first), the confusion PNG, and a calibrated last.ckpt."""
        was_training = self.training
        self.eval()
        fusion = self._refit_fusion() if self.drafter.confidence_logit is not None else None
        outputs = [self._logits(tuple(t.to(self.device) for t in batch))
                   for batch in self.trainer.datamodule.val_dataloader()]
        logits, labels = (torch.cat([x.float().cpu() for x in part]) for part in zip(*outputs))
        report = self._calibrate(logits, labels)
        if fusion is not None:
            report["fusion"] = fusion
            print(f"[hrad] late fusion refitted on validation: MLP weight {fusion['mlp_scale']:.4f}, confidence "
                  f"path W {[round(x, 3) for x in fusion['confidence_weight']]}")
        self.train(was_training)
        callback = self.trainer.checkpoint_callback
        directory = Path(callback.dirpath if callback is not None and callback.dirpath else
                         self.trainer.default_root_dir)
        if self.trainer.is_global_zero:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "confusion_matrix.png").write_bytes(confusion_png(report["confusion"]))
            (directory / "hrad_metrics.json").write_text(
                json.dumps({**report, "data": self.data_summary}, indent=2) + "\n")
        self.trainer.save_checkpoint(str(directory / "last.ckpt"))
        print(f"[hrad] val: recall {report['recall']}, ECE {report['ece_raw']:.4f} -> {report['ece']:.4f} "
              f"(T={report['temperature']:.3f}), NLL {report['nll']:.4f} -> {report['nll_calibrated']:.4f}; "
              f"confusion matrix: {directory / 'confusion_matrix.png'}")

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # What spectrain.export reads (export_hrad_checkpoint): kind, model config, target record, metrics.
        metrics = {f"val/{k}": v for k, v in self.final_metrics.items() if k not in ("confusion", "fusion")}
        if "fusion" in self.final_metrics:
            metrics["fusion"] = self.final_metrics["fusion"]
        checkpoint["spectrain"] = {"kind": "hrad", "config": self.drafter.config.to_dict(),
                                   "target": self.target_record, "recipe": dict(self.hparams["recipe"]),
                                   "metrics": {**metrics, "data": self.data_summary},
                                   "confusion": self.final_metrics.get("confusion")}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        meta = checkpoint.get("spectrain") or {}
        self.target_record = meta.get("target") or self.target_record


# ------------------------------------------------------------------------------------------------ export


def export_hrad_checkpoint(path: Path, cfg: Any) -> Path:
    """``python -m spectrain.export ckpt=PATH out=DIR`` for a kind=hrad Lightning checkpoint (native only)."""
    if cfg.format != "native":
        raise OverrideError(f"an H-RAD exports only as format=native; '{cfg.format}' is an EAGLE-3 layout")
    raw = read_lightning_checkpoint(path)  # a .ckpt file or an FSDP checkpoint directory
    meta = raw.get("spectrain") or {}
    if not meta.get("target"):
        raise CheckpointError(f"{path} has no target record: export a checkpoint saved by kind=hrad training")
    if cfg.target:
        want = model_identity(str(cfg.target))
        if (meta["target"]["config_hash"], meta["target"]["weights_hash"]) != (want["config_hash"],
                                                                             want["weights_hash"]):
            raise CheckpointError(f"{path} was trained for target '{meta['target']['name']}', not '{cfg.target}'")
    model = HRAD(HRADConfig.from_dict(meta["config"]))
    state = {k.removeprefix("drafter."): v for k, v in raw["state_dict"].items() if k.startswith("drafter.")}
    model.load_state_dict(state, strict=True)
    metrics = {**(meta.get("metrics") or {}), "global_step": raw.get("global_step"), "source": str(path)}
    png = confusion_png(meta["confusion"]) if meta.get("confusion") else None
    return save_native(model, cfg.out, target=meta["target"], recipe=meta.get("recipe"), metrics=metrics,
                       confusion_png=png)


register_kind(DrafterKind(name="hrad", build_module=HRADModule, build_datamodule=HRADDataModule,
                          model_schema=HRADSchema, export_checkpoint=export_hrad_checkpoint))
