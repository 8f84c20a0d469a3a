"""``python -m benchmarks.hrad_features traces=[DIR,...] [target=smollm2] [seeds=[0,1,2]] [out=FILE.json]``

What H-RAD's inputs say about SpecBranch's class 0 ("all reject": the target rejects the first continuation token
after the branch token), offline, on held-out prompts of acceptance traces (``data_prep.traces``, either kind of
position: ``positions=sps`` round starts or ``positions=specbranch`` surviving branches, where serving asks).

For every trace directory given, and every feature set, an H-RAD MLP (the recipe's: 256/64, dropout 0.2,
class-weighted cross-entropy, AdamW with warm-up and cosine, per-feature standardisation of the training split)
is trained on the training prompts of that directory and scored on the held-out prompts of every directory:

- ``hidden``: the paper's inputs, the target's last-4 hidden states + the branch token's embedding (5d);
- ``hidden+conf``: the same + the draft's confidence at the first continuation token (``confidence_feature``) as
  one more MLP input (``confidence_path=input``);
- ``hidden+conf_logit``: the same inputs, the confidence on its own linear path to the logits beside the MLP
  (``confidence_path=logit``: late fusion), as the recipe trains it: the MLP on ``1 - fusion_val_fraction`` of the
  training prompts, then the MLP's weight and the confidence path refitted on the rest (``fit_late_fusion``);
- ``conf``: the draft's confidence alone, no training: score = 1 - confidence (a threshold rule's ranking).

Reported per (trained on, evaluated on, features): the AUC of class 0 against the rest (score = P(class 0)),
averaged over ``seeds`` and for the seeds' mean probability (with a 95 % bootstrap CI over held-out prompts), and
the balanced accuracy of the 3-way argmax. Held-out prompts are the same for every directory (a seeded
``val_fraction`` of the union of their prompts), so traces of the same prompts never leak across the split.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from benchmarks.config import BenchConfig, Output, Target, parse_bench
from core.atomic import atomic_write_text
from core.drafters.hrad import HRAD, NUM_CLASSES, HRADConfig, check_boundaries, default_boundaries
from core.overrides import OverrideError, run_cli
from inference.algorithms.options import apply_threads
from spectrain.kinds.base import cosine_with_warmup
from spectrain.kinds.hrad.calibration import fit_late_fusion
from spectrain.kinds.hrad.data import class_weights, feature_stats, split_prompts
from spectrain.kinds.hrad.traces import TraceRows, load_trace_rows, read_input_embeddings, read_traces_manifest

USAGE = "python -m benchmarks.hrad_features traces=[DIR,...] target=smollm2 seeds=[0,1,2] out=FILE.json"
FEATURES = ("hidden", "hidden+conf", "hidden+conf_logit", "conf")
TRAINED = FEATURES[:-1]  # the arms that train an H-RAD; "conf" is the rule's ranking alone


@dataclass
class HRADFeaturesConfig(BenchConfig, Output, Target):
    """``out``: FILE.json (optional)."""

    traces: list[str] = field(default_factory=list)  # trace directories (data_prep.traces)
    val_fraction: float = 0.3  # prompts held out (the same prompts in every directory)
    split_seed: int = 0
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # training seeds per arm
    boundaries: list[int] | None = None  # None = [1, γ-1]
    steps: int = 150  # as recipe demo_hrad
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 20
    fusion_val_fraction: float = 0.2  # hidden+conf_logit: training prompts its fusion is refitted on (recipe's 0.2)
    bootstrap: int = 1000  # prompt resamples for the CI


# --------------------------------------------------------------------------------------------------- metrics


def auc(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """Area under the ROC curve of ``scores`` for the boolean ``positive`` (Mann-Whitney, ties count half);
    NaN without both kinds of row."""
    scores, positive = scores.double(), positive.bool()
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return math.nan
    order = scores.argsort()
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    sorted_scores = scores[order]
    start = 0
    while start < len(scores):  # average ranks over ties
        end = start
        while end + 1 < len(scores) and sorted_scores[end + 1] == sorted_scores[start]:
            end += 1
        if end > start:
            ranks[order[start : end + 1]] = (start + end) / 2 + 1
        start = end + 1
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def bootstrap_auc(
    scores: torch.Tensor, positive: torch.Tensor, prompts: torch.Tensor, n: int, seed: int = 0
) -> list[float]:
    """95 % CI of :func:`auc` over resampled prompts (rows of one prompt stay together)."""
    unique = prompts.unique()
    members = [torch.nonzero(prompts == p).squeeze(1) for p in unique]
    generator = torch.Generator().manual_seed(seed)
    values = []
    for _ in range(n):
        pick = torch.randint(0, len(unique), (len(unique),), generator=generator)
        rows = torch.cat([members[i] for i in pick.tolist()])
        value = auc(scores[rows], positive[rows])
        if not math.isnan(value):
            values.append(value)
    if not values:
        return [math.nan, math.nan]
    ordered = sorted(values)
    return [ordered[int(0.025 * (len(ordered) - 1))], ordered[int(0.975 * (len(ordered) - 1))]]


def balanced_accuracy(predicted: torch.Tensor, labels: torch.Tensor) -> float:
    recalls = [float((predicted[labels == c] == c).float().mean()) for c in range(NUM_CLASSES) if (labels == c).any()]
    return sum(recalls) / len(recalls) if recalls else math.nan


# --------------------------------------------------------------------------------------------------- training


@dataclass
class Split:
    hidden: torch.Tensor  # [n, K, d] (stored dtype)
    emb: torch.Tensor  # [n, d] float32
    confidence: torch.Tensor  # [n]
    labels: torch.Tensor  # [n]
    prompts: torch.Tensor  # [n]

    def rows(self, mask: torch.Tensor) -> Split:
        return Split(self.hidden[mask], self.emb[mask], self.confidence[mask], self.labels[mask], self.prompts[mask])


def train_hrad(
    train: Split, features: str, cfg: HRADFeaturesConfig, seed: int, gamma: int, boundaries: list[int]
) -> HRAD:
    """The recipe's H-RAD (class-weighted CE, AdamW, warm-up + cosine) on ``train``, with or without the
    confidence feature (as an MLP input or on its own path to the logits; the latter trained on a seeded
    ``1 - fusion_val_fraction`` of the prompts and its fusion refitted on the others, as the recipe does)."""
    if features not in TRAINED:
        raise OverrideError(f"features={features!r} is not one of {', '.join(TRAINED)}")
    if features == "hidden+conf_logit":
        held_out = split_prompts(train.prompts, cfg.fusion_val_fraction, seed)
        model = _train(train.rows(~held_out), features, cfg, seed, gamma, boundaries)
        val = train.rows(held_out)
        with torch.no_grad():
            mlp_logits, confidence = model.fusion_inputs(model.features(val.hidden, val.emb, val.confidence))
        alpha, w, b = fit_late_fusion(mlp_logits, confidence, val.labels, class_weights(train.rows(~held_out).labels))
        with torch.no_grad():
            model.mlp_scale.fill_(alpha)
            model.confidence_logit.weight.copy_(w)
            model.confidence_logit.bias.copy_(b)
        return model
    return _train(train, features, cfg, seed, gamma, boundaries)


def _train(train: Split, features: str, cfg: HRADFeaturesConfig, seed: int, gamma: int, boundaries: list[int]) -> HRAD:
    torch.manual_seed(seed)
    use_conf = features != "hidden"
    hidden_size = train.hidden.shape[-1]
    model = HRAD(
        HRADConfig(
            hidden_size=hidden_size,
            last_k=train.hidden.shape[1],
            gamma=gamma,
            boundaries=boundaries,
            confidence_feature=use_conf,
            confidence_path="logit" if features == "hidden+conf_logit" else "input",
        )
    )
    mean, std = feature_stats(train.hidden, train.emb, train.confidence if use_conf else None)
    model.feature_mean.copy_(mean)
    model.feature_std.copy_(std)
    weights = class_weights(train.labels)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: cosine_with_warmup(step, cfg.warmup_steps, cfg.steps, "cosine")
    )
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(train.labels), generator=generator)
    cursor = 0
    model.train()
    for _ in range(cfg.steps):
        if cursor + cfg.batch_size > len(order):
            order, cursor = torch.randperm(len(train.labels), generator=generator), 0
        batch = order[cursor : cursor + cfg.batch_size]
        cursor += cfg.batch_size
        logits = model(train.hidden[batch], train.emb[batch], train.confidence[batch] if use_conf else None)
        loss = F.cross_entropy(logits, train.labels[batch], weight=weights)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    return model.eval()


@torch.no_grad()
def class_probs(model: HRAD, rows: Split) -> torch.Tensor:
    use_conf = model.config.confidence_feature
    return model(rows.hidden, rows.emb, rows.confidence if use_conf else None).softmax(-1)


# --------------------------------------------------------------------------------------------------- the run


def load_split(
    directory: str, target: str, boundaries: list[int] | None, embeddings: torch.Tensor
) -> tuple[Split, dict[str, Any], list[int]]:
    manifest = read_traces_manifest(directory, target, 4)
    gamma = int(manifest["args"]["gamma"])
    bounds = check_boundaries(boundaries or default_boundaries(gamma), gamma)
    rows: TraceRows = load_trace_rows(directory, manifest, bounds, 4)
    keep = ~rows.confidence.isnan()
    split = Split(rows.hidden, embeddings[rows.tokens].float(), rows.confidence, rows.labels, rows.prompts)
    return split.rows(keep), manifest, bounds


def name_of(directory: str, manifest: dict[str, Any]) -> str:
    return f"{manifest['args'].get('positions', 'sps')}:{Path(directory).name}"


def run(cfg: HRADFeaturesConfig) -> dict[str, Any]:
    if not cfg.traces:
        raise OverrideError(f"traces=[DIR,...] is required (data_prep.traces directories); usage: {USAGE}")
    if not 0 < cfg.val_fraction < 1:
        raise OverrideError(f"val_fraction must be in (0, 1), got {cfg.val_fraction}")
    if not 0 < cfg.fusion_val_fraction < 1:
        raise OverrideError(f"fusion_val_fraction must be in (0, 1), got {cfg.fusion_val_fraction}")
    apply_threads(cfg)
    embeddings = read_input_embeddings(cfg.target)
    data: dict[str, tuple[Split, int, list[int]]] = {}
    for directory in cfg.traces:
        split, manifest, bounds = load_split(directory, cfg.target, cfg.boundaries, embeddings)
        data[name_of(directory, manifest)] = (split, int(manifest["args"]["gamma"]), bounds)
    gammas = {gamma for _, gamma, _ in data.values()}
    if len(gammas) != 1:
        raise OverrideError(f"the traces were recorded with different gamma {sorted(gammas)}: compare one gamma")
    prompts = torch.cat([split.prompts for split, _, _ in data.values()]).unique()
    order = prompts[torch.randperm(len(prompts), generator=torch.Generator().manual_seed(cfg.split_seed))]
    held_out = order[: max(1, round(cfg.val_fraction * len(prompts)))]
    parts = {
        name: (split.rows(~torch.isin(split.prompts, held_out)), split.rows(torch.isin(split.prompts, held_out)))
        for name, (split, _, _) in data.items()
    }
    results: list[dict[str, Any]] = []
    counts = {
        name: {
            "train": torch.bincount(train.labels, minlength=NUM_CLASSES).tolist(),
            "held_out": torch.bincount(test.labels, minlength=NUM_CLASSES).tolist(),
        }
        for name, (train, test) in parts.items()
    }
    for eval_name, (_, test) in parts.items():  # confidence alone: no training
        positive = test.labels == 0
        score = 1 - test.confidence
        results.append(
            {
                "trained_on": None,
                "evaluated_on": eval_name,
                "features": "conf",
                "auc": auc(score, positive),
                "auc_ci95": bootstrap_auc(score, positive, test.prompts, cfg.bootstrap),
            }
        )
    for train_name, (train, _) in parts.items():
        gamma, bounds = data[train_name][1], data[train_name][2]
        for features in TRAINED:
            models = [train_hrad(train, features, cfg, seed, gamma, bounds) for seed in cfg.seeds]
            for eval_name, (_, test) in parts.items():
                positive = test.labels == 0
                probs = [class_probs(model, test) for model in models]
                mean = torch.stack(probs).mean(0)
                results.append(
                    {
                        "trained_on": train_name,
                        "evaluated_on": eval_name,
                        "features": features,
                        "auc_per_seed": [auc(p[:, 0], positive) for p in probs],
                        "auc": auc(mean[:, 0], positive),
                        "auc_ci95": bootstrap_auc(mean[:, 0], positive, test.prompts, cfg.bootstrap),
                        "balanced_accuracy_per_seed": [balanced_accuracy(p.argmax(-1), test.labels) for p in probs],
                    }
                )
    settings = OmegaConf.to_container(cfg) if OmegaConf.is_config(cfg) else asdict(cfg)
    summary = {
        "config": settings,
        "class_counts": counts,
        "held_out_prompts": sorted(int(p) for p in held_out),
        "results": results,
    }
    if cfg.out:
        atomic_write_text(Path(cfg.out), json.dumps(summary, indent=2) + "\n")
    return summary


def _fmt(x: float) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def table(summary: dict[str, Any]) -> str:
    lines = [
        "| trained on | evaluated on (held-out prompts) | features | AUC class 0 vs rest [95 % CI] | "
        "AUC per seed | balanced acc. per seed |",
        "|---|---|---|---|---|---|",
    ]
    for r in summary["results"]:
        low, high = r["auc_ci95"]
        lines.append(
            f"| {r['trained_on'] or '– (no training)'} | {r['evaluated_on']} | {r['features']} | "
            f"{_fmt(r['auc'])} [{_fmt(low)}, {_fmt(high)}] | "
            f"{' / '.join(_fmt(a) for a in r.get('auc_per_seed', [])) or '–'} | "
            f"{' / '.join(_fmt(a) for a in r.get('balanced_accuracy_per_seed', [])) or '–'} |"
        )
    counts = "; ".join(
        f"{name}: train {c['train']}, held-out {c['held_out']}" for name, c in summary["class_counts"].items()
    )
    return "\n".join(lines) + f"\n\nRows per class (0 / 1 / 2): {counts}\n"


def parse_args(argv: Sequence[str]) -> Any:
    return parse_bench(argv, HRADFeaturesConfig, USAGE)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(
        argv,
        lambda args: table(run(parse_args(args))),
        doc=__doc__,
        schema=HRADFeaturesConfig,
        report=print,
    )


if __name__ == "__main__":
    sys.exit(main())
