"""``python -m data_prep.ngram_corpus target=smollm2 source=sharegpt out=FILE [n_samples=2000]``

Builds Self-Draft's corpus cache (docs/algorithms/self_draft.md §9), target tokenizer: for 1..4-token keys, the 4-grams
that follow each key in the corpus, at most 20 per key by descending count, only counts > 5. Every turn of
every conversation (user and assistant) is one document; grams never cross documents. The paper used OANC,
which is not available here: ShareGPT (or any ``load_prompts`` source, e.g. ``jsonl:PATH``) stands in.

Counting is vectorised: the (key + gram) windows of all documents are counted with ``np.unique`` over rows,
so memory is about 2 x tokens x 8 x 4 bytes per key length.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from core import assets
from core.assets import tokenizer_fingerprint
from core.atomic import check_output
from core.errors import UserError
from core.overrides import OverrideError, parse_cli, run_cli
from core.prompts import load_prompts
from inference.ngram_cache import CorpusCache, Gram

USAGE = "python -m data_prep.ngram_corpus target=smollm2 source=sharegpt out=FILE n_samples=2000"
KEY_LENS = (1, 2, 3, 4)
GRAM_LEN = 4


@dataclass
class NgramCorpusConfig:
    target: str = "smollm2"  # model name or directory whose tokenizer defines the token ids
    source: str = "sharegpt"  # any core.prompts source: sharegpt, mt_bench, humaneval, gsm_symbolic, jsonl:PATH
    out: str = ""
    n_samples: int = 2000  # conversations read from the source
    split: str = "train"  # all | train | eval (hash split of core.prompts)
    max_per_key: int = 20
    min_count: int = 6  # keep grams seen at least this often (the original: count > 5)


def count_ngrams(
    docs: Iterable[Sequence[int]],
    key_lens: Sequence[int] = KEY_LENS,
    gram_len: int = GRAM_LEN,
    max_per_key: int = 20,
    min_count: int = 6,
    progress=None,
) -> dict[int, dict[Gram, list[tuple[Gram, int]]]]:
    """``{key_len: {key: [(gram, count), ...]}}``: the ``gram_len`` tokens following every occurrence of each
    ``key_len``-token key, at most ``max_per_key`` per key (count descending, ties by gram), count >= min_count.
    """
    if min(key_lens, default=1) < 1 or gram_len < 1 or max_per_key < 1:
        raise UserError(f"need key lengths, gram_len and max_per_key >= 1; got {key_lens}, {gram_len}, {max_per_key}")
    arrays = [np.asarray(d, dtype=np.int64) for d in docs if len(d)]
    tokens = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    doc_id = np.repeat(np.arange(len(arrays)), [len(a) for a in arrays])
    dtype = np.int32 if tokens.size == 0 or tokens.max() < 2**31 else np.int64
    tokens = tokens.astype(dtype)
    tables: dict[int, dict[Gram, list[tuple[Gram, int]]]] = {}
    for key_len in key_lens:
        width = key_len + gram_len
        tables[key_len] = {}
        if tokens.size >= width:
            windows = np.lib.stride_tricks.sliding_window_view(tokens, width)
            same_doc = doc_id[: len(windows)] == doc_id[width - 1 :]
            rows, counts = np.unique(windows[same_doc], axis=0, return_counts=True)  # rows sorted by key, gram
            frequent = counts >= min_count
            tables[key_len] = _top_per_key(rows[frequent], counts[frequent], key_len, max_per_key)
        if progress is not None:
            progress.update(1)
    return tables


def _top_per_key(
    rows: np.ndarray, counts: np.ndarray, key_len: int, max_per_key: int
) -> dict[Gram, list[tuple[Gram, int]]]:
    # Sort by key, then count descending; np.unique already sorted grams within a key, so ties stay by gram.
    order = np.lexsort((-counts, *[rows[:, c] for c in reversed(range(key_len))]))
    table: dict[Gram, list[tuple[Gram, int]]] = {}
    for row, count in zip(rows[order].tolist(), counts[order].tolist()):
        grams = table.setdefault(tuple(row[:key_len]), [])
        if len(grams) < max_per_key:
            grams.append((tuple(row[key_len:]), int(count)))
    return table


def corpus_documents(source: str, n_samples: int, split: str = "train") -> list[str]:
    """The text of every turn of the first ``n_samples`` conversations of a prompt source."""
    return [
        turn["content"]
        for conv in load_prompts(source, n=n_samples, split=split)
        for turn in conv.turns
        if turn["content"].strip()
    ]


def build_corpus(cfg: NgramCorpusConfig) -> CorpusCache:
    from tqdm.auto import tqdm  # tqdm: a heavy import, deferred to first use

    tokenizer = assets.load_tokenizer(cfg.target)
    texts = corpus_documents(cfg.source, cfg.n_samples, cfg.split)
    if not texts:
        raise UserError(f"source '{cfg.source}' (split {cfg.split}) gave no text")
    docs: list[list[int]] = []
    batch = 64
    with tqdm(total=len(texts), desc="tokenize", unit="doc", file=sys.stderr) as progress:
        for i in range(0, len(texts), batch):
            docs.extend(tokenizer(texts[i : i + batch], add_special_tokens=False)["input_ids"])
            progress.update(len(texts[i : i + batch]))
    with tqdm(total=len(KEY_LENS), desc="count", unit="key length", file=sys.stderr) as progress:
        tables = count_ngrams(docs, KEY_LENS, GRAM_LEN, cfg.max_per_key, cfg.min_count, progress)
    meta = {
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "target": cfg.target,
        "vocab_size": len(tokenizer),
        "source": cfg.source,
        "split": cfg.split,
        "n_samples": cfg.n_samples,
        "n_documents": len(docs),
        "n_tokens": int(sum(len(d) for d in docs)),
        "key_lens": list(KEY_LENS),
        "gram_len": GRAM_LEN,
        "max_per_key": cfg.max_per_key,
        "min_count": cfg.min_count,
    }
    return CorpusCache(tables, meta)


def _build(args: list[str]) -> tuple[Any, CorpusCache]:
    cfg = parse_cli(args, NgramCorpusConfig, USAGE)
    if not cfg.out:
        raise OverrideError(f"out=FILE is required; usage: {USAGE}")
    if cfg.n_samples < 1 or cfg.max_per_key < 1 or cfg.min_count < 1:
        raise OverrideError("n_samples, max_per_key and min_count must be >= 1")
    check_output(cfg.out, file=True)
    corpus = build_corpus(cfg)
    corpus.save(cfg.out)
    return cfg, corpus


def _report(outcome: tuple[Any, CorpusCache]) -> None:
    cfg, corpus = outcome
    keys = ", ".join(f"{n}: {k}" for n, k in corpus.num_keys().items())
    print(
        f"wrote {cfg.out}: {corpus.meta['n_tokens']} tokens from {corpus.meta['n_documents']} documents; "
        f"keys per key length {{{keys}}}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(argv, _build, doc=__doc__, schema=NgramCorpusConfig, report=_report)


if __name__ == "__main__":
    sys.exit(main())
