"""``manifest.json``: what a feature or trace directory holds, and the identities it must match.

A manifest is a *header* (everything that decides the content: kind, arguments, target / tokenizer / chat
template identity, layer ids and convention, dtypes) plus the commit log the shard writer keeps (``shards``,
``next_source_index``, totals, ``complete``). The header is compared key by key when a run resumes into an
existing directory and when training loads the data, so a mismatch is refused with the key that differs.

Schema (``kind`` = features; traces differ in ``columns`` and add ``drafter``)::

    format, format_version      "spectrain.features", 1
    kind, spectrain_version     "features", "0.1.0"
    args                        every CLI argument that decides the content (all but out=)
    target                      name, config_hash, weights_hash (core.assets.model_identity),
                                model_type, vocab_size, num_layers, hidden_size
    tokenizer                   vocab_hash, vocab_size, chat_template_hash
    columns                     {name: {dtype, shape, meaning}} (data_prep.shards)
    layers                      spec ("eagle3"), ids ([1, 14, 26]), convention (core.layer_ids)
    compute                     device type and dtype the target ran in
    shards                      [{name, num_rows, num_tokens, first_source_index, end_source_index,
                                  skipped, bytes, sha256}]
    next_source_index, num_rows, num_tokens, skipped, complete
    processes                   (written by N > 1 processes) N; shard entries then name their process
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core import __version__
from core.assets import chat_template_hash, model_identity, tokenizer_fingerprint
from core.atomic import atomic_write_text
from core.errors import UserError

MANIFEST_NAME = "manifest.json"
RANKS_DIR = "ranks"  # the commit logs of the processes of a multi-process run (data_prep.ranks)
FORMAT_VERSION = 1
# Written by the shard writer; never part of the comparison.
LOG_KEYS = ("shards", "next_source_index", "num_rows", "num_tokens", "skipped", "complete", "processes")


def commit_log(part: str | None = None) -> str:
    """Where a dataset's writer commits, relative to its directory: ``manifest.json``, or the own log of one of
    several processes (``part``, e.g. ``rank-0-of-2``: ``data_prep.ranks``)."""
    return f"{RANKS_DIR}/{part}.json" if part else MANIFEST_NAME


class DatasetError(UserError):
    """A dataset directory that cannot be used as asked; the message is one line naming the problem and fix."""


def tokenizer_identity(tokenizer) -> dict[str, Any]:
    """Vocabulary hash and chat-template hash: a dataset tokenized with another tokenizer or template is wrong."""
    return {
        "vocab_hash": tokenizer_fingerprint(tokenizer),
        "vocab_size": len(tokenizer),
        "chat_template_hash": chat_template_hash(tokenizer),
    }


def target_identity(name: str, config) -> dict[str, Any]:
    """``core.assets.model_identity`` plus the shape facts a consumer checks (layers, hidden size)."""
    return {
        **model_identity(str(name)),
        "num_layers": int(config.num_hidden_layers),
        "hidden_size": int(config.hidden_size),
    }


def new_header(
    kind: str,
    args: dict[str, Any],
    target: dict[str, Any],
    tokenizer: dict[str, Any],
    columns: dict[str, Any],
    **extra: Any,
) -> dict[str, Any]:
    """A manifest header; ``extra`` holds kind-specific blocks (``layers``, ``drafter``, ...), also compared."""
    return {
        "format": "spectrain." + kind,
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "spectrain_version": __version__,
        "args": args,
        "target": target,
        "tokenizer": tokenizer,
        "columns": columns,
        **extra,
    }


def header_of(manifest: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in manifest.items() if k not in LOG_KEYS}


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        flat: dict[str, Any] = {}
        for key, sub in value.items():
            flat.update(_flatten(sub, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): value}


def header_differences(stored: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """``key: stored != wanted`` for every dotted header key that differs (missing keys included)."""
    old, new = _flatten(header_of(stored)), _flatten(header_of(wanted))
    return [
        f"{key}: {old.get(key, '<absent>')!r} != {new.get(key, '<absent>')!r}"
        for key in sorted(set(old) | set(new))
        if old.get(key, "<absent>") != new.get(key, "<absent>")
    ]


def settings_mismatch(directory: str | Path, diffs: list[str]) -> DatasetError:
    more = f" (+{len(diffs) - 2} more)" if len(diffs) > 2 else ""
    return DatasetError(
        f"{directory} holds a dataset made with different settings ({'; '.join(diffs[:2])}{more}): "
        "re-run with the original arguments to resume, or choose a new out=DIR"
    )


def refuse_other_args(directory: str | Path, args: dict[str, Any], name: str = MANIFEST_NAME) -> None:
    """Early, before any model is loaded: refuse to resume a directory written with other arguments. (The
    writer later compares the whole header, identities included.) ``name``: a process's own log instead."""
    if (Path(directory) / name).is_file():
        diffs = header_differences({"args": read_manifest(directory, name).get("args")}, {"args": args})
        if diffs:
            raise settings_mismatch(directory, diffs)


def read_manifest(directory: str | Path, name: str = MANIFEST_NAME) -> dict[str, Any]:
    """``directory/manifest.json`` (or a process's own commit log, ``name`` = ``ranks/rank-R-of-N.json``)."""
    path = Path(directory) / name
    if not path.is_file() and name == MANIFEST_NAME and (Path(directory) / RANKS_DIR).is_dir():
        raise DatasetError(
            f"{directory} is unfinished: its processes' parts are in {Path(directory) / RANKS_DIR} and "
            "the manifest is written when all are complete; re-run the same torchrun command"
        )
    if not path.is_file():
        raise DatasetError(
            f"{directory} has no {name}: not a spectrain dataset (create one with "
            "python -m data_prep.extract or data_prep.traces)"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DatasetError(
            f"{path} is not valid JSON ({err.msg} at line {err.lineno}); restore or re-create the dataset"
        ) from None
    if not isinstance(manifest, dict) or not str(manifest.get("format", "")).startswith("spectrain."):
        raise DatasetError(f"{path} is not a spectrain manifest (no 'format' key)")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DatasetError(
            f"{path} has format_version {manifest.get('format_version')}, this spectrain reads "
            f"{FORMAT_VERSION}; re-create the dataset"
        )
    return manifest


def write_manifest(directory: str | Path, manifest: dict[str, Any], name: str = MANIFEST_NAME) -> None:
    """Atomic: a reader (or a resumed run) sees the old manifest or the new one, never half of one."""
    path = Path(directory) / name
    atomic_write_text(path, json.dumps(manifest, indent=2) + "\n")
