"""The n-gram caches Self-Draft draws its candidates from (docs/algorithms/self_draft.md §2, §7–9).

* :class:`ContextCache` -- token -> up to ``per_key`` distinct grams, in LRU order; filled during decoding from
  the draft branches and the committed text, and kept across prompts by the algorithm instance
  (:class:`LoggedContextCache`: a request's copy, whose insertions are replayed into the shared one at its end).
* :class:`CorpusCache` -- a static table, for key lengths 1..4, of the most frequent 4-grams that follow each
  key in a corpus. Built by ``python -m data_prep.ngram_corpus``; stored as versioned JSON that records the
  tokenizer it was built with, because token ids mean nothing under another tokenizer.

The caches only propose candidates; verification decides what is emitted, so their content never affects the
output, only the speed.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from core.atomic import atomic_write_text

Gram = tuple[int, ...]

CORPUS_FORMAT = "spectrain.ngram_corpus"
CORPUS_VERSION = 1


class ContextCache:
    """Per key token, at most ``per_key`` distinct grams ordered from least to most recently inserted."""

    def __init__(self, per_key: int = 10):
        if per_key < 1:
            raise ValueError(f"per_key must be >= 1, got {per_key}")
        self.per_key = per_key
        self._grams: dict[int, OrderedDict[Gram, None]] = {}

    def insert(self, key: int, gram: Sequence[int]) -> None:
        """Reinsertion moves a gram to the most-recent end; a full key drops its least recent gram."""
        grams = self._grams.setdefault(key, OrderedDict())
        gram = tuple(gram)
        if gram in grams:
            grams.move_to_end(gram)
            return
        if len(grams) >= self.per_key:
            grams.popitem(last=False)
        grams[gram] = None

    def retrieve(self, key: int) -> list[Gram]:
        """The grams stored under ``key``, least recent first."""
        grams = self._grams.get(key)
        return list(grams) if grams else []

    def trim(self, keep: int) -> None:
        """Keep only the ``keep`` most recent grams of every key (the periodic flush of §7)."""
        for key in list(self._grams):
            grams = self._grams[key]
            while len(grams) > keep:
                grams.popitem(last=False)
            if not grams:
                del self._grams[key]

    def clear(self) -> None:
        self._grams.clear()

    def copy(self) -> ContextCache:
        twin = ContextCache(self.per_key)
        twin._grams = {key: OrderedDict(grams) for key, grams in self._grams.items()}
        return twin

    def __len__(self) -> int:
        """Number of stored grams over all keys."""
        return sum(len(g) for g in self._grams.values())


class LoggedContextCache(ContextCache):
    """A copy of a :class:`ContextCache` that logs its insertions in order, so they can be replayed into the cache
    it was copied from (:meth:`replay_into`): a request's own view of a cache that requests running beside it
    share."""

    def __init__(self, base: ContextCache):
        super().__init__(base.per_key)
        self._grams = base.copy()._grams
        self.log: list[tuple[int, Gram]] = []

    def insert(self, key: int, gram: Sequence[int]) -> None:
        self.log.append((key, tuple(gram)))
        super().insert(key, gram)

    def replay_into(self, cache: ContextCache) -> None:
        """Insert into ``cache`` what was inserted here, in the same order (into the very cache this one copied,
        unchanged since: it ends equal to this one)."""
        for key, gram in self.log:
            cache.insert(key, gram)


class CorpusCache:
    """``tables[key_len][key] -> [(gram, count), ...]``, counts descending; ``meta`` describes the build."""

    def __init__(self, tables: dict[int, dict[Gram, list[tuple[Gram, int]]]], meta: dict[str, Any] | None = None):
        self.tables = {int(n): table for n, table in tables.items()}
        self.meta = dict(meta or {})
        # Longest key first: a longer matching context predicts the continuation better (§8).
        self._key_lens = sorted(self.tables, reverse=True)

    def lookup(self, context: Sequence[int], limit: int, exclude: Iterable[Gram] = ()) -> list[Gram]:
        """Up to ``limit`` grams continuing ``context``: keys from the last 4, 3, 2, 1 tokens in that order,
        each key's grams by descending count, skipping grams in ``exclude`` or already chosen."""
        chosen: list[Gram] = []
        seen = set(exclude)
        for key_len in self._key_lens:
            if len(chosen) >= limit:
                break
            if len(context) < key_len:
                continue
            for gram, _count in self.tables[key_len].get(tuple(context[-key_len:]), ()):
                if gram not in seen:
                    chosen.append(gram)
                    seen.add(gram)
                    if len(chosen) >= limit:
                        break
        return chosen

    @property
    def max_token_id(self) -> int:
        return max(
            (max(k + g) for table in self.tables.values() for k, grams in table.items() for g, _ in grams), default=-1
        )

    def num_keys(self) -> dict[int, int]:
        return {n: len(table) for n, table in sorted(self.tables.items())}

    def save(self, path: str | Path) -> None:
        """Write versioned JSON (atomically): metadata plus ``tables[key_len] = [[key, [[gram, count], ..]], ..]``."""
        payload = {
            "format": CORPUS_FORMAT,
            "version": CORPUS_VERSION,
            **self.meta,
            "tables": {
                str(n): [[list(key), [[list(g), c] for g, c in grams]] for key, grams in table.items()]
                for n, table in sorted(self.tables.items())
            },
        }
        atomic_write_text(Path(path), json.dumps(payload, separators=(",", ":")))

    @classmethod
    def load(cls, path: str | Path, tokenizer_fingerprint: str | None = None) -> CorpusCache:
        """Read a file written by :meth:`save`; refuse (one line) another format, version or tokenizer."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"n-gram corpus '{path}' does not exist; build one with python -m data_prep.ngram_corpus")
        try:
            payload = json.loads(path.read_text())
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ValueError(f"n-gram corpus '{path}' is not valid JSON: {str(exc).splitlines()[0]}") from None
        if not isinstance(payload, dict) or payload.get("format") != CORPUS_FORMAT:
            raise ValueError(f"'{path}' is not a spectrain n-gram corpus (format {CORPUS_FORMAT!r} expected)")
        if payload.get("version") != CORPUS_VERSION:
            raise ValueError(
                f"n-gram corpus '{path}' has version {payload.get('version')}, this code reads "
                f"{CORPUS_VERSION}; rebuild it with python -m data_prep.ngram_corpus"
            )
        built_for = payload.get("tokenizer_fingerprint")
        if tokenizer_fingerprint is not None and built_for != tokenizer_fingerprint:
            raise ValueError(
                f"n-gram corpus '{path}' was built for another tokenizer (fingerprint {built_for}, "
                f"target's {tokenizer_fingerprint}); rebuild it with this target's tokenizer"
            )
        tables = {
            int(n): {tuple(key): [(tuple(g), int(c)) for g, c in grams] for key, grams in entries}
            for n, entries in payload.pop("tables").items()
        }
        meta = {k: v for k, v in payload.items() if k not in ("format", "version")}
        return cls(tables, meta)
