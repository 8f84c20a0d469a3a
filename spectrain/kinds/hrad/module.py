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

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from core.assets import AssetError, resolve_model_dir
from core.distributed import process_mean
from core.drafters.hrad import (
    DEFAULT_EPSILON,
    HRAD,
    NUM_CLASSES,
    HRADConfig,
    HRADError,
    check_boundaries,
    default_boundaries,
)
from core.overrides import RecipeError
from data_prep.manifest import DatasetError
from spectrain.kinds.base import DrafterModule
from spectrain.kinds.hrad.calibration import fit_late_fusion, fit_temperature
from spectrain.kinds.hrad.data import HRADDataModule
from spectrain.kinds.hrad.export import export_hrad_checkpoint
from spectrain.kinds.hrad.report import classification_metrics, confusion_png
from spectrain.kinds.hrad.traces import last_k_of, read_traces_manifest
from spectrain.registry import DrafterKind, register_kind

BALANCE = ("weights", "sampler", "none")


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


class HRADModule(L.LightningModule):
    def __init__(self, cfg: Any):
        super().__init__()

        self.save_hyperparameters({"recipe": OmegaConf.to_container(cfg, resolve=True)})
        self.cfg = cfg
        model = cfg.model
        if model.balance not in BALANCE:
            raise RecipeError(f"model.balance={model.balance} is not one of {', '.join(BALANCE)}")
        if not 0.0 < model.val_fraction < 1.0:
            raise RecipeError(f"model.val_fraction={model.val_fraction} must be in (0, 1)")
        last_k = last_k_of(cfg.data.layers)
        try:  # every path and the traces' identity, before any work (the dry run stops after this)
            target_config = json.loads((resolve_model_dir(cfg.target) / "config.json").read_text())
            manifest = read_traces_manifest(cfg.data.dataset_dir, cfg.target, last_k)
            gamma = int(manifest["args"]["gamma"])
            config = HRADConfig(
                hidden_size=int((target_config.get("text_config") or target_config)["hidden_size"]),
                last_k=last_k,
                mlp_hidden=list(model.mlp_hidden),
                dropout=model.dropout,
                gamma=gamma,
                boundaries=check_boundaries(model.boundaries or default_boundaries(gamma), gamma),
                epsilon=model.epsilon,
                confidence_feature=bool(model.confidence_feature),
                confidence_path=str(model.confidence_path),
            )
        except (AssetError, DatasetError, HRADError) as exc:
            raise RecipeError(str(exc)) from None
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
        weight = (
            self.class_weights[labels]
            if self.cfg.model.balance == "weights"
            else torch.ones_like(labels, dtype=torch.float)
        )
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
        outputs = [
            self._logits(tuple(t.to(self.device) for t in batch)) for batch in self.trainer.datamodule.val_dataloader()
        ]
        logits, labels = (torch.cat([x.float().cpu() for x in part]) for part in zip(*outputs))
        report = self._calibrate(logits, labels)
        if fusion is not None:
            report["fusion"] = fusion
            print(
                f"[hrad] late fusion refitted on validation: MLP weight {fusion['mlp_scale']:.4f}, confidence "
                f"path W {[round(x, 3) for x in fusion['confidence_weight']]}"
            )
        self.train(was_training)
        callback = self.trainer.checkpoint_callback
        directory = Path(
            callback.dirpath if callback is not None and callback.dirpath else self.trainer.default_root_dir
        )
        if self.trainer.is_global_zero:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "confusion_matrix.png").write_bytes(confusion_png(report["confusion"]))
            (directory / "hrad_metrics.json").write_text(
                json.dumps({**report, "data": self.data_summary}, indent=2) + "\n"
            )
        self.trainer.save_checkpoint(str(directory / "last.ckpt"))
        print(
            f"[hrad] val: recall {report['recall']}, ECE {report['ece_raw']:.4f} -> {report['ece']:.4f} "
            f"(T={report['temperature']:.3f}), NLL {report['nll']:.4f} -> {report['nll_calibrated']:.4f}; "
            f"confusion matrix: {directory / 'confusion_matrix.png'}"
        )

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # What spectrain.export reads (export_hrad_checkpoint): kind, model config, target record, metrics.
        metrics = {f"val/{k}": v for k, v in self.final_metrics.items() if k not in ("confusion", "fusion")}
        if "fusion" in self.final_metrics:
            metrics["fusion"] = self.final_metrics["fusion"]
        checkpoint["spectrain"] = {
            "kind": "hrad",
            "config": self.drafter.config.to_dict(),
            "target": self.target_record,
            "recipe": dict(self.hparams["recipe"]),
            "metrics": {**metrics, "data": self.data_summary},
            "confusion": self.final_metrics.get("confusion"),
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        meta = checkpoint.get("spectrain") or {}
        self.target_record = meta.get("target") or self.target_record


register_kind(
    DrafterKind(
        name="hrad",
        build_module=HRADModule,
        build_datamodule=HRADDataModule,
        model_schema=HRADSchema,
        export_checkpoint=export_hrad_checkpoint,
    )
)
