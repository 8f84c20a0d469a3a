"""H-RAD's classification figures: NLL, ECE, recalls, balanced accuracy and the confusion matrix (and its PNG)."""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.nn.functional as F

from core.drafters.hrad import CLASS_NAMES, NUM_CLASSES


def classification_metrics(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, ece_bins: int = 10
) -> dict[str, Any]:
    """Recall per class, confusion matrix (rows: true, columns: predicted), NLL and ECE raw and at
    ``temperature`` (argmax decisions do not depend on it)."""
    # torchmetrics: a heavy import, deferred to first use
    from torchmetrics.classification import MulticlassCalibrationError, MulticlassConfusionMatrix, MulticlassRecall

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
            ax.text(
                j,
                i,
                f"{int(matrix[i, j])}\n{100 * rates[i, j]:.0f}%",
                ha="center",
                va="center",
                color="white" if rates[i, j] > 0.6 else "black",
                fontsize=9,
            )
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
