"""H-RAD, SpecBranch's rollback-aware draft-length classifier (docs/algorithms/specbranch.md §3), and the
inference-facing predictor a SpecBranch implementation codes against.

**Inputs** at a branch point (the branch token x_t was just accepted by the target):

- ``hidden_lastk`` [n, K, d]: the target's last K entries of the HF ``hidden_states`` tuple at position t-1 (the
  position whose output predicted x_t), in tuple order: raw outputs of decoder layers L-K .. L-2, then the
  final-normed state. With the engine's runner: ``capture_layers=predictor.capture_layers`` +
  ``return_last_hidden=True``, then :func:`stack_lastk` (``core.layer_ids``: ``lastK``).
- ``token_emb`` [n, d]: the target's input embedding of x_t (``runner.embed_tokens(x_t)``).
- ``confidence`` [n] (only when the config's ``confidence_feature`` is on; not in the paper): the draft's own
  confidence max_v q(v) (temperature 1) at the first continuation token, i.e. of the distribution after x_t that
  the draft drew its first continuation token from. An export without the key (written before it existed) reads
  as off. The config's ``confidence_path`` says where it enters: ``input`` (one more MLP input; what an export
  without the key reads as) or ``logit`` (its own linear path to the logits beside the MLP, see **Model**).

**Output** of :meth:`HRADPredictor.predict`: calibrated class probabilities [n, 3] (float32, rows sum to 1):

- class 0 ``all_reject``: keep none of the survivor's continuation tokens (next branch point right after x_t);
- class 1 ``confidence``: keep continuation tokens while the draft confidence max_v q(v) >= ``epsilon``
  (checked from the 2nd continuation token on);
- class 2 ``all_accept``: keep all γ-1 continuation tokens.

**Labels** (training): c = accepted continuation tokens after the accepted branch token (``num_accepted - 1`` of
a ``data_prep.traces`` round with draft length γ), class = #{b in boundaries : c >= b}; the default boundaries
``[1, γ-1]`` give 0 / 1..γ-2 / γ-1 (= ``data_prep.traces.hrad_class``).

**Model**: ``Linear(5d→256) → ReLU → Dropout(0.2) → Linear(256→64) → ReLU → Dropout(0.2) → Linear(64→3)`` on
float32 inputs, as in the authors' code (5d+1 inputs with the confidence feature and ``confidence_path=input``).
With ``confidence_path=logit`` (wide and deep, late fusion) the MLP reads the 5d target features only and the
standardised confidence c reaches the logits through its own ``Linear(1→3)``: logits = α·MLP(z_5d) + W·c + b.
Joint training alone does not keep the MLP from drowning c (on a few hundred rows it fits the ~2,880 hidden-state
inputs' noise, and its held-out logits are ~100× the confidence path's), so after training α (``mlp_scale``, a
stored scalar, 1 while training) and W, b are refitted on held-out rows (stacking,
``spectrain.kinds.hrad.calibration.fit_late_fusion``): the MLP keeps only the weight those rows support, and where it has
none the model is a logistic regression on the confidence, which ranks rows as the confidence rule does. Ours adds two fixed (not trained) pieces, both stored in the export: a
per-feature standardisation measured on the training split (raw residual streams have a few huge channels that
otherwise dominate the first layer), and a softmax temperature fitted after training on held-out rounds.

**Export dir** (:func:`save_native`): ``config.json`` with a ``spectrain`` block (kind ``hrad``, target identity,
hidden size, last_k, layer ids + convention, classes, boundaries, ε, confidence feature and path, temperature),
``model.safetensors``, ``metrics.json``, ``recipe.yaml`` (when known), ``confusion_matrix.png`` (when known).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from core.assets import load_safetensors, read_json
from core.atomic import atomic_directory
from core.errors import UserError
from core.layer_ids import LAYER_CONVENTION, resolve_layers

KIND = "hrad"
CLASS_NAMES = ("all_reject", "confidence", "all_accept")
NUM_CLASSES = len(CLASS_NAMES)
DEFAULT_EPSILON = 0.3  # §3: the dev drafter's and most historical versions' confidence threshold
PROBE_ROWS, PROBE_DIMS = 8, 64  # embedding rows/dims an export keeps to recognise its target's weights
CONFIDENCE_PATHS = ("input", "logit")  # where the confidence feature enters: an MLP input / its own path to the logits


class HRADError(UserError):
    """An H-RAD export that cannot be used as asked; the message is one line naming the problem and the fix."""


# ------------------------------------------------------------------------------------------------ labels


def default_boundaries(gamma: int) -> list[int]:
    """0 accepted continuation tokens / some / all γ-1 (SpecBranch's 3 classes for a γ-token survivor)."""
    return [1, gamma - 1]


def check_boundaries(boundaries: Any, gamma: int) -> list[int]:
    """Two increasing thresholds 1 <= b1 < b2 <= γ-1 on the accepted continuation count, or a one-line error."""
    values = list(boundaries) if isinstance(boundaries, Sequence) and not isinstance(boundaries, str) else None
    if (
        values is None
        or len(values) != NUM_CLASSES - 1
        or not all(isinstance(b, int) and not isinstance(b, bool) for b in values)
        or not 1 <= values[0] < values[1] <= gamma - 1
    ):
        raise HRADError(
            f"boundaries={boundaries!r} must be two integers 1 <= b1 < b2 <= gamma-1 = {gamma - 1} "
            f"(accepted continuation tokens that start classes 1 and 2); default {default_boundaries(gamma)}"
            + (" (gamma must be >= 3 for 3 classes)" if gamma < 3 else "")
        )
    return [int(b) for b in values]


def hrad_labels(num_accepted: torch.Tensor, boundaries: list[int]) -> torch.Tensor:
    """Class per round from the verifier's accepted count (branch token included); -1 where the branch token
    itself was rejected (H-RAD only runs on a surviving branch)."""
    continuation = num_accepted.long() - 1
    labels = (continuation[:, None] >= torch.tensor(boundaries, dtype=torch.long)).sum(-1)
    return torch.where(num_accepted > 0, labels, torch.full_like(labels, -1))


# ------------------------------------------------------------------------------------------------- model


@dataclass
class HRADConfig:
    hidden_size: int  # d of the target
    last_k: int = 4  # hidden_states entries read (K)
    mlp_hidden: list[int] = field(default_factory=lambda: [256, 64])
    dropout: float = 0.2
    gamma: int = 7  # draft length of the rounds it was trained on (branch token + γ-1 continuation)
    boundaries: list[int] = field(default_factory=lambda: default_boundaries(7))
    epsilon: float = DEFAULT_EPSILON  # class 1's draft-confidence threshold (used by the algorithm, stored here)
    confidence_feature: bool = False  # z also holds the draft's confidence at the first continuation token
    # where that confidence enters: "input" (one more MLP input) | "logit" (Linear(1→3) added to the MLP's logits)
    confidence_path: str = "input"

    def __post_init__(self) -> None:
        if self.confidence_path not in CONFIDENCE_PATHS:
            raise HRADError(
                f"confidence_path={self.confidence_path!r} is not one of {', '.join(CONFIDENCE_PATHS)} "
                "(input: one more MLP input; logit: a direct linear path to the logits)"
            )
        if self.confidence_path == "logit" and not self.confidence_feature:
            raise HRADError(
                "confidence_path=logit routes the draft's confidence to the logits: it needs confidence_feature=true"
            )

    @property
    def in_features(self) -> int:
        """Width of z and of its standardisation: 5d, + 1 with the confidence feature (either path)."""
        return (self.last_k + 1) * self.hidden_size + int(self.confidence_feature)

    @property
    def late_confidence(self) -> bool:
        """The confidence bypasses the MLP (``confidence_path=logit``)."""
        return self.confidence_feature and self.confidence_path == "logit"

    @property
    def mlp_in_features(self) -> int:
        return self.in_features - int(self.late_confidence)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HRADConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise HRADError(f"unknown H-RAD config keys {unknown}: this export was written by a newer spectrain")
        return cls(**{k: list(v) if isinstance(v, (list, tuple)) else v for k, v in data.items()})


class HRAD(nn.Module):
    """The 3-way MLP over z = [hidden_lastk ; token_emb] (+ the confidence, as an input or on its own linear path
    to the logits); ``forward`` returns uncalibrated logits."""

    def __init__(self, config: HRADConfig):
        super().__init__()
        check_boundaries(config.boundaries, config.gamma)
        self.config = config
        layers: list[nn.Module] = []
        width = config.mlp_in_features
        for hidden in config.mlp_hidden:
            layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(config.dropout)]
            width = hidden
        layers.append(nn.Linear(width, NUM_CLASSES))
        self.mlp = nn.Sequential(*layers)
        # confidence_path=logit: the standardised confidence's own path to the logits, beside the MLP
        self.confidence_logit = nn.Linear(1, NUM_CLASSES) if config.late_confidence else None
        if self.confidence_logit is not None:  # starts with no opinion (then trained, and refitted held out)
            nn.init.zeros_(self.confidence_logit.weight)
            nn.init.zeros_(self.confidence_logit.bias)
        # Fixed, saved with the weights: standardisation of z (training split) and the calibration temperature.
        self.register_buffer("feature_mean", torch.zeros(config.in_features))
        self.register_buffer("feature_std", torch.ones(config.in_features))
        self.register_buffer("temperature", torch.ones(()))
        if self.confidence_logit is not None:  # the MLP's weight in the logits: 1 in training, then fitted on
            self.register_buffer("mlp_scale", torch.ones(()))  # held-out rows with the confidence path (stacking)

    def features(
        self, hidden_lastk: torch.Tensor, token_emb: torch.Tensor, confidence: torch.Tensor | None = None
    ) -> torch.Tensor:
        """z = [hidden_lastk flattened in tuple order ; token_emb (; confidence)], float32 [n, (K+1)·d (+1)]."""
        n = hidden_lastk.shape[0]
        parts = [hidden_lastk.reshape(n, -1).float(), token_emb.reshape(n, -1).float()]
        if self.config.confidence_feature:
            if confidence is None:
                raise HRADError(
                    "this H-RAD reads the draft's confidence at the first continuation token "
                    "(confidence_feature); pass confidence=[n]"
                )
            parts.append(confidence.reshape(n, 1).float().to(parts[0].device))
        return torch.cat(parts, dim=-1)

    def forward(
        self, hidden_lastk: torch.Tensor, token_emb: torch.Tensor, confidence: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.logits_from_features(self.features(hidden_lastk, token_emb, confidence))

    def logits_from_features(self, z: torch.Tensor) -> torch.Tensor:
        z = (z.float() - self.feature_mean) / self.feature_std
        if self.confidence_logit is None:
            return self.mlp(z)
        mlp_logits, confidence = self.fusion_inputs(z, standardised=True)
        return self.mlp_scale * mlp_logits + self.confidence_logit(confidence)

    def fusion_inputs(self, z: torch.Tensor, standardised: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``confidence_path=logit``: (the MLP's logits [n, 3] before ``mlp_scale``, the standardised confidence
        [n, 1]) of features z, what the held-out refit of the fusion reads."""
        if self.confidence_logit is None:
            raise HRADError("fusion_inputs needs confidence_path=logit")
        if not standardised:
            z = (z.float() - self.feature_mean) / self.feature_std
        return self.mlp(z[:, :-1]), z[:, -1:]

    def calibrated_probs(self, logits: torch.Tensor) -> torch.Tensor:
        return (logits.float() / self.temperature).softmax(-1)


def capture_layers(num_layers: int, last_k: int = 4) -> list[int]:
    """Runner capture ids (output of decoder layer i) for the first K-1 blocks; the K-th is ``last_hidden``."""
    return resolve_layers(f"last{last_k}", num_layers)


def stack_lastk(hidden: Mapping[int, torch.Tensor], last_hidden: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """[..., K, d] from a runner's captured ``hidden`` {layer: [..., d]} and ``last_hidden`` [..., d]."""
    return torch.stack([hidden[i] for i in layers] + [last_hidden], dim=-2)


def embedding_probe(embed_weight: torch.Tensor) -> torch.Tensor:
    """A few fixed rows/dims of the target's input embedding (float32): how an export recognises its target's
    weights from a runner alone, whatever dtype the runner holds them in."""
    vocab, dims = embed_weight.shape
    rows = torch.linspace(0, vocab - 1, PROBE_ROWS).long().to(embed_weight.device)
    return embed_weight[rows, : min(dims, PROBE_DIMS)].detach().float().cpu()


# ------------------------------------------------------------------------------------------------ export


def save_native(
    model: HRAD,
    out: str | Path,
    *,
    target: Mapping[str, Any],
    recipe: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    confusion_png: bytes | None = None,
) -> Path:
    """Write an export dir atomically (it must not exist). ``target``: the target record (name, config/weights
    hashes, model_type, vocab_size, num_layers, hidden_size, embed_probe)."""
    from safetensors.torch import save_file  # safetensors: a heavy import, deferred to first use

    out = Path(out)
    if out.exists():
        raise HRADError(f"out={out} already exists; choose a new directory (exports are never overwritten)")
    missing = [k for k in ("num_layers", "hidden_size", "vocab_size", "embed_probe") if k not in target]
    if missing:
        raise HRADError(f"the target record lacks {missing}: export from a checkpoint trained by kind=hrad")
    config = model.config
    if int(target["hidden_size"]) != config.hidden_size:
        raise HRADError(
            f"H-RAD reads hidden size {config.hidden_size} but the target record says {target['hidden_size']}"
        )
    block = {
        "kind": KIND,
        "target": dict(target),
        "hidden_size": config.hidden_size,
        "last_k": config.last_k,
        "layers": {
            "ids": capture_layers(int(target["num_layers"]), config.last_k),
            "plus_final_norm": True,
            "convention": LAYER_CONVENTION,
            "position": "branch token position - 1",
        },
        "classes": list(CLASS_NAMES),
        "boundaries": list(config.boundaries),
        "gamma": config.gamma,
        "epsilon": config.epsilon,
        "confidence_feature": config.confidence_feature,
        "confidence_path": config.confidence_path,
        **({"mlp_scale": float(model.mlp_scale)} if config.late_confidence else {}),
        "temperature": float(model.temperature),
        "config": config.to_dict(),
    }
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
    with atomic_directory(out) as tmp:
        (tmp / "config.json").write_text(json.dumps({"architectures": ["HRAD"], "spectrain": block}, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "metrics.json").write_text(json.dumps(dict(metrics or {}), indent=2, default=str) + "\n")
        if recipe is not None:
            (tmp / "recipe.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(dict(recipe))))
        if confusion_png is not None:
            (tmp / "confusion_matrix.png").write_bytes(confusion_png)
    return out


def load_native(path: str | Path) -> tuple[HRAD, dict[str, Any]]:
    """(model in eval mode, float32 on CPU; the ``spectrain`` block) from an export dir."""

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise HRADError(
            f"'{path}' is not an H-RAD export (no config.json); make one with python -m spectrain.export "
            "ckpt=runs/<run>/checkpoints/last.ckpt out=DIR"
        )
    block = read_json(config_file, fix="re-export it (python -m spectrain.export)").get("spectrain") or {}
    if block.get("kind") != KIND:
        raise HRADError(f"'{path}' holds a '{block.get('kind')}' drafter, not an H-RAD (kind=hrad)")
    if not (path / "model.safetensors").is_file():
        raise HRADError(f"'{path}' has no model.safetensors; re-export it")
    model = HRAD(HRADConfig.from_dict(block["config"]))
    state = load_safetensors(path / "model.safetensors", fix="re-export it (python -m spectrain.export)")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise HRADError(
            f"'{path}/model.safetensors' does not fit its config.json "
            f"({str(exc).splitlines()[1].strip() if len(str(exc).splitlines()) > 1 else exc}); re-export"
        ) from None
    return model.eval(), block


# --------------------------------------------------------------------------------------------- inference


class HRADPredictor:
    """Calibrated H-RAD class probabilities for a SpecBranch implementation (see the module docstring)."""

    def __init__(self, model: HRAD, block: Mapping[str, Any]):
        self.model = model.eval()
        self.block = dict(block)
        config = model.config
        self.last_k: int = config.last_k
        self.hidden_size: int = config.hidden_size
        self.gamma: int = config.gamma  # the survivor length the classes refer to (γ-1 continuation tokens)
        self.boundaries: list[int] = list(config.boundaries)
        self.epsilon: float = float(config.epsilon)
        self.confidence_feature: bool = bool(config.confidence_feature)  # predict() then needs confidence=
        self.confidence_path: str = config.confidence_path  # where it enters (input | logit); predict() is the same
        self.classes: tuple[str, ...] = CLASS_NAMES
        self.capture_layers: list[int] = list(self.block["layers"]["ids"])  # + return_last_hidden=True

    @property
    def temperature(self) -> float:
        return float(self.model.temperature)

    def to(self, device: str | torch.device) -> HRADPredictor:
        self.model.to(device)
        return self

    @torch.no_grad()
    def predict(
        self, hidden_lastk: torch.Tensor, token_emb: torch.Tensor, confidence: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Calibrated probabilities [n, 3] (float32, on the model's device) for ``hidden_lastk`` [n, K, d] and
        ``token_emb`` [n, d] (any float dtype/device; moved to the model's), and ``confidence`` [n] when the
        H-RAD reads it (``confidence_feature``)."""
        k, d = self.last_k, self.hidden_size
        if hidden_lastk.dim() != 3 or tuple(hidden_lastk.shape[1:]) != (k, d):
            raise ValueError(
                f"hidden_lastk must be [n, {k}, {d}] (last {k} hidden_states entries), got {list(hidden_lastk.shape)}"
            )
        if token_emb.dim() != 2 or token_emb.shape != (hidden_lastk.shape[0], d):
            raise ValueError(
                f"token_emb must be [{hidden_lastk.shape[0]}, {d}] (input embedding of the branch token), "
                f"got {list(token_emb.shape)}"
            )
        if self.confidence_feature and (confidence is None or confidence.numel() != hidden_lastk.shape[0]):
            raise ValueError(
                f"this H-RAD reads the draft's confidence at the first continuation token: pass "
                f"confidence=[{hidden_lastk.shape[0]}], got "
                f"{None if confidence is None else list(confidence.shape)}"
            )
        device = self.model.temperature.device
        logits = self.model(
            hidden_lastk.to(device), token_emb.to(device), None if confidence is None else confidence.to(device)
        )
        return self.model.calibrated_probs(logits)

    def predict_class(
        self, hidden_lastk: torch.Tensor, token_emb: torch.Tensor, confidence: torch.Tensor | None = None
    ) -> torch.Tensor:
        """argmax class [n] (0 all_reject, 1 confidence, 2 all_accept), as SpecBranch uses it."""
        return self.predict(hidden_lastk, token_emb, confidence).argmax(-1)


def _runner_of(target: Any) -> Any:
    return getattr(target, "runner", target)  # an inference.drafters.LoadedModel or a runner


def check_target(block: Mapping[str, Any], target: Any, where: str = "this H-RAD") -> None:
    """Refuse (``HRADError``, one line) a target runner other than the one the H-RAD was trained for: shapes
    first, then the embedding probe (same shapes, other weights)."""
    runner = _runner_of(target)
    config = runner.config
    record = block["target"]
    have = (int(config.hidden_size), int(config.num_hidden_layers), int(config.vocab_size))
    want = (int(record["hidden_size"]), int(record["num_layers"]), int(record["vocab_size"]))
    probe = torch.tensor(record["embed_probe"], dtype=torch.float32)
    same = have == want
    if same:
        mine = embedding_probe(runner.embed_tokens.weight)
        # bf16 / fp16 runners round the embedding: compare at a tolerance far above rounding, far below any retrain
        same = mine.shape == probe.shape and bool((mine - probe).abs().max() <= 1e-2 * probe.abs().max() + 1e-6)
    if not same:
        raise HRADError(
            f"{where} was trained for target '{record.get('name')}' (hidden {want[0]}, {want[1]} layers, "
            f"vocab {want[2]}, weights {record.get('weights_hash')}), not this one (hidden {have[0]}, "
            f"{have[1]} layers, vocab {have[2]}{', other weights' if have == want else ''}): train an "
            "H-RAD for this target (python -m spectrain.fit recipe=hrad_* target=...)"
        )


def load_hrad(path: str | Path, target_runner: Any) -> HRADPredictor:
    """The predictor of an export dir, on ``target_runner``'s device (a runner or a ``LoadedModel``); refuses an
    H-RAD trained for another target in one line."""
    model, block = load_native(path)
    check_target(block, target_runner, where=f"H-RAD '{path}'")
    return HRADPredictor(model, block).to(_runner_of(target_runner).device)
