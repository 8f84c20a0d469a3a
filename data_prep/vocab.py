"""``python -m data_prep.vocab dataset=DIR draft_vocab_size=K out=FILE``: the EAGLE-3 reduced draft vocabulary.

Counts assistant tokens (``loss_mask == 1``) in a feature dataset, or in a prompt source tokenized with the
target's tokenizer (``target=smollm2 source=sharegpt n_samples=N max_len=L`` instead of ``dataset=``), keeps the
K most frequent ids (ties: lower id first; if fewer than K ids occur, the lowest unused ids fill up), sorts them
ascending into ``used[0..K-1]`` and writes the ``d2t`` / ``t2d`` map of :mod:`core.vocab`
(docs/algorithms/eagle3.md §3, docs/algorithms/eagle3_export.md) as safetensors with metadata (sizes,
assistant-token coverage, what was counted).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.assets import load_tokenizer, model_identity
from core.atomic import check_output
from core.errors import UserError
from core.overrides import OverrideError, parse_cli, run_cli
from core.vocab import build_vocab_map, save_vocab_map
from data_prep.features import check_features
from data_prep.manifest import tokenizer_identity
from data_prep.samples import SampleBuilder, load_source, require_answers
from data_prep.shards import ShardReader

USAGE = (
    "python -m data_prep.vocab dataset=DIR draft_vocab_size=K out=FILE  |  python -m data_prep.vocab "
    "target=smollm2 source=sharegpt n_samples=N max_len=L draft_vocab_size=K out=FILE"
)


@dataclass
class VocabConfig:
    dataset: str | None = None  # a data_prep.extract directory
    target: str | None = None  # with source=: tokenize prompts with this target's tokenizer
    source: str | None = None
    n_samples: int = 1000
    max_len: int = 2048
    split: str = "all"
    seed: int = 0
    draft_vocab_size: int = 32000
    chat_template: str = "auto"  # with source=: how conversations are rendered: auto | none (text as is) | PATH
    out: str | None = None


def count_tokens(sequences: Iterable[tuple[np.ndarray, np.ndarray]], vocab_size: int) -> np.ndarray:
    """Frequencies [V] of the tokens with mask 1 over ``(input_ids, loss_mask)`` pairs."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in sequences:
        ids = np.asarray(ids)[np.asarray(mask).astype(bool)]
        if ids.size and (ids.max() >= vocab_size or ids.min() < 0):
            raise UserError(f"token id {int(ids.max())} is outside the target vocabulary of {vocab_size}")
        counts += np.bincount(ids, minlength=vocab_size)
    return counts


def counts_from_dataset(directory: str | Path) -> tuple[np.ndarray, dict[str, str]]:
    manifest = check_features(directory)
    reader = ShardReader(directory, manifest)
    vocab = int(manifest["target"]["vocab_size"])
    counts = count_tokens(zip(reader.column_arrays("input_ids"), reader.column_arrays("loss_mask")), vocab)
    return counts, {
        "counted": f"dataset {directory}",
        "target_config_hash": manifest["target"]["config_hash"],
        "tokenizer_vocab_hash": manifest["tokenizer"]["vocab_hash"],
    }


def source_token_counts(cfg: Any, tokenizer: Any, vocab_size: int) -> np.ndarray:
    """Frequencies [V] of the assistant tokens of ``cfg.source`` (n_samples, max_len, split, seed) as ``tokenizer``
    renders them (the target's, with the run's chat template)."""
    conversations = load_source(cfg.source, cfg.n_samples, cfg.seed, cfg.split)
    require_answers(conversations, False, cfg.source)
    build = SampleBuilder(tokenizer, cfg.max_len)
    samples = (s for i, c in enumerate(conversations) if (s := build(i, c)) is not None)
    return count_tokens(((s.input_ids, s.loss_mask) for s in samples), vocab_size)


def counts_from_source(cfg: Any) -> tuple[np.ndarray, dict[str, str]]:
    identity = model_identity(cfg.target)
    tokenizer = load_tokenizer(cfg.target, cfg.get("chat_template", "auto"))
    counts = source_token_counts(cfg, tokenizer, int(identity["vocab_size"]))
    return counts, {
        "counted": f"source {cfg.source} (n_samples={cfg.n_samples}, max_len={cfg.max_len}, split={cfg.split})",
        "target_config_hash": identity["config_hash"],
        "tokenizer_vocab_hash": tokenizer_identity(tokenizer)["vocab_hash"],
    }


def make_vocab(cfg: Any) -> dict[str, Any]:
    if bool(cfg.dataset) == bool(cfg.source):
        raise OverrideError(f"give exactly one of dataset=DIR or source=NAME (with target=); usage: {USAGE}")
    if cfg.source and not cfg.target:
        raise OverrideError("source= needs target= (whose tokenizer and chat template tokenize the prompts)")
    if not cfg.out:
        raise OverrideError(f"out=FILE is required; usage: {USAGE}")
    check_output(cfg.out, file=True)
    counts, provenance = counts_from_dataset(cfg.dataset) if cfg.dataset else counts_from_source(cfg)
    total = int(counts.sum())
    if total == 0:
        raise UserError("no assistant token was counted (every loss_mask is 0); check the source")
    d2t, t2d = build_vocab_map(counts, cfg.draft_vocab_size)
    covered = int(counts[t2d.numpy()].sum())
    info = {
        "target_vocab_size": len(counts),
        "draft_vocab_size": cfg.draft_vocab_size,
        "counted_tokens": total,
        "distinct_tokens": int((counts > 0).sum()),
        "coverage": round(covered / total, 6),
        **provenance,
    }
    save_vocab_map(cfg.out, d2t, t2d, info)
    return {**info, "out": str(cfg.out)}


def _report(info: dict) -> None:
    print(
        f"[vocab] {info['draft_vocab_size']} of {info['target_vocab_size']} ids cover {info['coverage']:.2%} of "
        f"{info['counted_tokens']:,} assistant tokens ({info['distinct_tokens']:,} distinct); wrote {info['out']}",
        file=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(
        argv,
        lambda args: make_vocab(parse_cli(args, VocabConfig, USAGE)),
        doc=__doc__,
        schema=VocabConfig,
        report=_report,
    )


if __name__ == "__main__":
    sys.exit(main())
