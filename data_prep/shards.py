"""Arrow shards written incrementally, committed atomically, logged in the manifest; and read back memory-mapped.

One writer serves feature datasets (``data_prep.extract``) and acceptance traces (``data_prep.traces``).

Layout::

    DIR/manifest.json                 the source of truth (``data_prep.manifest``)
    DIR/shards/shard-00000/data.arrow one ``datasets`` Arrow stream file per shard

Resume protocol. Work is a stream of *source items* (a sample, a prompt) numbered from 0; each item gives zero
or more rows. Rows stream into a hidden temporary shard directory; a shard is committed by renaming that
directory into place (``core.atomic.atomic_directory``) and THEN rewriting the manifest atomically with
the shard's entry and ``next_source_index``. A process killed at any moment leaves either a committed shard that
the manifest lists, or leftovers the manifest does not list (a temporary directory, or a renamed shard whose
manifest update never happened); a resumed run deletes the leftovers and restarts at ``next_source_index``.
So no row is lost or written twice, provided items are produced deterministically from their index.

Column specs (stored in the manifest under ``columns``): ``{"dtype": D, "shape": S}`` with ``S`` one of ``[]``,
``["T"]``, ``[W]`` or ``["T", W]`` (``T`` = the sample's token count). ``bfloat16`` and ``float8_e4m3fn`` have no
Arrow type, so they are stored as their int16 / int8 bit patterns and viewed back on load (lossless). A spec may
name the column holding its scales (``"scale": "aux_hidden_scale"``: fp8 features, ``data_prep.fp8``).
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.assets import sha256_file
from core.atomic import atomic_directory
from core.errors import UserError
from data_prep.manifest import (
    RANKS_DIR,
    DatasetError,
    commit_log,
    header_differences,
    read_manifest,
    settings_mismatch,
    write_manifest,
)

SHARDS_DIR = "shards"
SHARD_FILE = "data.arrow"
STORAGE_DTYPE = {
    "bfloat16": "int16",
    "float8_e4m3fn": "int8",
    "float16": "float16",
    "float32": "float32",
    "int64": "int64",
    "int32": "int32",
    "int16": "int16",
    "int8": "int8",
    "bool": "bool",
}
TORCH_DTYPE = {
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float16": torch.float16,
    "float32": torch.float32,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "bool": torch.bool,
}
BIT_PATTERN = {"bfloat16": torch.int16, "float8_e4m3fn": torch.int8}  # dtypes Arrow lacks: stored as their bits


# ------------------------------------------------------------------------------------------- column specs


def column(dtype: str, shape: list, meaning: str, scale: str | None = None) -> dict[str, Any]:
    """A column spec; ``scale``: the column holding this one's dequantization scales (fp8)."""
    if dtype not in STORAGE_DTYPE:
        raise ValueError(f"unsupported column dtype {dtype}; use one of {', '.join(STORAGE_DTYPE)}")
    spec = {"dtype": dtype, "shape": list(shape), "meaning": meaning}
    if scale is not None:
        spec["scale"] = scale
    return spec


def arrow_features(columns: dict[str, dict[str, Any]]):
    """``datasets.Features`` for column specs (see the module docstring)."""
    from datasets import Array2D, Features, List, Value  # datasets: a heavy import, deferred to first use

    features = {}
    for name, spec in columns.items():
        storage, shape = STORAGE_DTYPE[spec["dtype"]], spec["shape"]
        if len(shape) == 0:
            features[name] = Value(storage)
        elif len(shape) == 1:
            features[name] = List(Value(storage))
        elif len(shape) == 2 and shape[0] == "T" and isinstance(shape[1], int):
            features[name] = Array2D(shape=(None, shape[1]), dtype=storage)
        else:
            raise ValueError(f"column {name}: unsupported shape {shape}")
    return Features(features)


def to_storage(value: torch.Tensor | np.ndarray | list | int | float, spec: dict[str, Any]):
    """One row's value in its Arrow storage form (numpy; bfloat16 / float8 as their int16 / int8 bit patterns)."""
    if not spec["shape"]:
        return value.item() if isinstance(value, (torch.Tensor, np.ndarray)) else value
    if isinstance(value, torch.Tensor):
        value = value.detach().to("cpu", TORCH_DTYPE[spec["dtype"]]).contiguous()
        if spec["dtype"] in BIT_PATTERN:
            value = value.view(BIT_PATTERN[spec["dtype"]])
        return value.numpy()
    return np.asarray(value, dtype=STORAGE_DTYPE[spec["dtype"]])


def to_tensor(array: np.ndarray | int | float, spec: dict[str, Any]) -> torch.Tensor:
    """Inverse of :func:`to_storage`; zero-copy where the storage allows (the array stays memory-mapped)."""
    if not isinstance(array, np.ndarray):
        return torch.tensor(array, dtype=TORCH_DTYPE[spec["dtype"]])
    if not array.flags.writeable:  # Arrow buffers are read-only; torch wants writable memory, so copy once
        array = array.copy()
    tensor = torch.from_numpy(array)
    return tensor.view(TORCH_DTYPE[spec["dtype"]]) if spec["dtype"] in BIT_PATTERN else tensor


# ------------------------------------------------------------------------------------------------ writer


def shard_name(index: int, prefix: str = "shard") -> str:
    return f"{prefix}-{index:05d}"


class ShardWriter:
    """Appends rows to atomically committed shards; resumes an interrupted run of the same header.

    ``ShardWriter(dir, header, shard_size)`` starts a new dataset in ``dir`` (absent or empty; created on the
    first write), or resumes it when its manifest has the same header, or refuses in one line naming the
    differing keys. Feed it with ``add(rows, source_end=...)`` in source order; a shard is committed once it
    holds ``shard_size`` rows, at the item boundary. ``finish()`` commits the tail and marks it complete.
    """

    def __init__(self, directory: str | Path, header: dict[str, Any], shard_size: int, *, part: str | None = None):
        if shard_size < 1:
            raise UserError(f"shard_size must be >= 1, got {shard_size}")
        self.directory = Path(directory)
        # One of several processes writing into one directory (data_prep.ranks): its own commit log and shard names.
        self.part = part
        self.log_name = commit_log(part)
        self.prefix = part or "shard"
        self.shard_size = shard_size
        self.columns: dict[str, dict[str, Any]] = header["columns"]
        self.features = arrow_features(self.columns)
        self.manifest = self._open(header)
        self._stack: contextlib.ExitStack | None = None  # holds the open atomic_directory of the current shard
        self._tmp: Path | None = None
        self._arrow = None
        self._rows = self._tokens = self._skipped = 0
        self._first = self._end = self.next_source_index

    # -- opening / resuming ------------------------------------------------------------------------------

    def _open(self, header: dict[str, Any]) -> dict[str, Any]:
        """Validate (and clean up) an existing directory; a new one is only created by the first write, so a
        run refused before writing (e.g. for disk space) leaves nothing behind."""
        if (self.directory / self.log_name).is_file():
            manifest = read_manifest(self.directory, self.log_name)
            diffs = header_differences(manifest, header)
            if diffs:
                raise settings_mismatch(self.directory, diffs)
            self._drop_leftovers(manifest)
            verify_shards(self.directory, manifest)
            self._created = True
            return manifest
        others = (SHARDS_DIR, RANKS_DIR) if self.part else ()  # the other processes' parts
        if self.directory.exists() and any(p.name not in others for p in self.directory.iterdir()):
            raise DatasetError(
                f"{self.directory} exists, is not empty and has no manifest.json: choose a new or empty out=DIR"
            )
        self._created = False
        return {
            **header,
            "shards": [],
            "next_source_index": 0,
            "num_rows": 0,
            "num_tokens": 0,
            "skipped": 0,
            "complete": False,
        }

    def _create(self) -> None:
        if not self._created:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_manifest(self.directory, self.manifest, self.log_name)
            self._created = True

    def _drop_leftovers(self, manifest: dict[str, Any]) -> None:
        """Delete shard directories the manifest does not list (a kill before the manifest update)."""
        listed = {entry["name"] for entry in manifest["shards"]}
        shards_dir = self.directory / SHARDS_DIR
        if shards_dir.is_dir():
            for path in shards_dir.iterdir():
                mine = path.name.lstrip(".").startswith(self.prefix + "-")  # never another process's shard
                if path.name not in listed and (mine or not self.part):
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
        log = self.directory / self.log_name
        for path in log.parent.glob(f".{log.name}.tmp-*"):
            path.unlink()

    # -- state -------------------------------------------------------------------------------------------

    @property
    def next_source_index(self) -> int:
        """The first source item not yet committed: where a (resumed) run starts."""
        return int(self.manifest["next_source_index"])

    @property
    def complete(self) -> bool:
        return bool(self.manifest["complete"])

    # -- writing -----------------------------------------------------------------------------------------

    def add(self, rows: list[dict[str, Any]], *, source_end: int, skipped: int = 0, num_tokens: int = 0) -> None:
        """Append the rows of source items up to ``source_end`` (exclusive); ``skipped`` counts items that gave
        no row. Values may be tensors, arrays or scalars; they are converted to each column's spec."""
        if self.complete:
            raise DatasetError(f"{self.directory} is complete; nothing more can be added")
        if source_end < self._end:
            raise ValueError(f"source_end {source_end} goes backwards (at {self._end})")
        self._create()
        if rows:
            if self._arrow is None:
                self._start_shard()
            batch = {name: [to_storage(row[name], spec) for row in rows] for name, spec in self.columns.items()}
            self._arrow.write_batch(batch)
        self._rows += len(rows)
        self._tokens += num_tokens
        self._skipped += skipped
        self._end = source_end
        if self._rows >= self.shard_size:
            self._commit()

    def finish(self) -> dict[str, Any]:
        """Commit the tail, mark the manifest complete and return it."""
        if self.complete:
            return self.manifest
        if self._rows:
            self._commit()
        if not self.manifest["shards"]:
            raise DatasetError(
                f"no source item produced a row ({self._skipped} skipped); nothing written to "
                f"{self.directory} (check the source and its assistant turns)"
            )
        if self._end > self.next_source_index:  # trailing items without rows: they belong to the last shard
            last = self.manifest["shards"][-1]
            last["end_source_index"] = self._end
            last["skipped"] += self._skipped
            self.manifest["skipped"] += self._skipped
            self.manifest["next_source_index"] = self._end
        self.manifest["complete"] = True
        write_manifest(self.directory, self.manifest, self.log_name)
        return self.manifest

    def close(self) -> None:
        """Drop an uncommitted shard (its rows are redone by the next run)."""
        if self._arrow is not None:
            self._arrow.close()
            self._arrow = None
        if self._stack is not None:
            # exiting the stack with an error deletes the temporary directory (atomic_directory renames nothing);
            # that error is not raised again, while anything failing inside is a bug and propagates
            stack, self._stack = self._stack, None
            stack.__exit__(RuntimeError, RuntimeError("shard aborted"), None)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start_shard(self) -> None:
        from datasets.arrow_writer import ArrowWriter  # datasets: a heavy import, deferred to first use

        name = shard_name(len(self.manifest["shards"]), self.prefix)
        self._stack = contextlib.ExitStack()
        tmp = self._stack.enter_context(atomic_directory(self.directory / SHARDS_DIR / name))
        self._arrow = ArrowWriter(features=self.features, path=str(tmp / SHARD_FILE))
        self._tmp = tmp

    def _commit(self) -> None:
        num_rows, _ = self._arrow.finalize()
        self._arrow.close()
        self._arrow = None
        entry = {
            "name": shard_name(len(self.manifest["shards"]), self.prefix),
            "num_rows": num_rows,
            "num_tokens": self._tokens,
            "first_source_index": self._first,
            "end_source_index": self._end,
            "skipped": self._skipped,
            "bytes": (self._tmp / SHARD_FILE).stat().st_size,
            "sha256": sha256_file(self._tmp / SHARD_FILE),
        }
        self._stack.close()  # the atomic rename into shards/<name>
        self._stack = None
        # Only now does the shard exist for readers and resumed runs.
        self.manifest["shards"].append(entry)
        self.manifest["next_source_index"] = self._end
        self.manifest["num_rows"] += num_rows
        self.manifest["num_tokens"] += self._tokens
        self.manifest["skipped"] += self._skipped
        write_manifest(self.directory, self.manifest, self.log_name)
        self._rows = self._tokens = self._skipped = 0
        self._first = self._end


# ------------------------------------------------------------------------------------------------ reader


def verify_shards(directory: str | Path, manifest: dict[str, Any], checksums: bool = False) -> None:
    """Every listed shard exists with its recorded size (and sha256 if ``checksums``); the first bad one is
    reported by name, never skipped."""
    for entry in manifest["shards"]:
        path = Path(directory) / SHARDS_DIR / entry["name"] / SHARD_FILE
        where = f"shard {entry['name']} of {directory}"
        if not path.is_file():
            raise DatasetError(f"{where} is missing ({path}); re-create the dataset in a new out=DIR")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise DatasetError(
                f"{where} is truncated or altered ({size} bytes, manifest says {entry['bytes']}); "
                "re-create the dataset in a new out=DIR"
            )
        if checksums and sha256_file(path) != entry["sha256"]:
            raise DatasetError(
                f"{where} is corrupt (sha256 differs from the manifest); re-create the dataset in a new out=DIR"
            )


class ShardReader:
    """All committed shards of a directory, memory-mapped through ``datasets`` (``Dataset.from_file``).

    ``row(i)`` returns ``{column: numpy array or scalar}`` in storage dtype, zero-copy views into the mapped
    files; ``to_tensor(value, spec)`` turns them into tensors of the logical dtype.
    """

    def __init__(self, directory: str | Path, manifest: dict[str, Any] | None = None, checksums: bool = False):
        from datasets import Dataset  # datasets: a heavy import, deferred to first use

        self.directory = Path(directory)
        self.manifest = manifest if manifest is not None else read_manifest(directory)
        self.columns: dict[str, dict[str, Any]] = self.manifest["columns"]
        verify_shards(self.directory, self.manifest, checksums)
        self.tables = []
        for entry in self.manifest["shards"]:
            path = self.directory / SHARDS_DIR / entry["name"] / SHARD_FILE
            try:
                table = Dataset.from_file(str(path)).data.table
            except Exception as exc:  # Arrow's own errors are multi-line and do not name the shard
                raise DatasetError(
                    f"shard {entry['name']} of {directory} cannot be read "
                    f"({str(exc).splitlines()[0][:120]}); re-create the dataset"
                ) from None
            if table.num_rows != entry["num_rows"] or set(table.column_names) != set(self.columns):
                raise DatasetError(
                    f"shard {entry['name']} of {directory} holds {table.num_rows} rows / columns "
                    f"{sorted(table.column_names)}, the manifest lists {entry['num_rows']} / "
                    f"{sorted(self.columns)}; re-create the dataset"
                )
            self.tables.append(table)
        self.offsets = np.cumsum([0] + [t.num_rows for t in self.tables])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def locate(self, index: int) -> tuple[int, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range for {len(self)} rows")
        shard = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return shard, index - int(self.offsets[shard])

    def row(self, index: int, columns: list[str] | None = None) -> dict[str, Any]:
        shard, local = self.locate(index)
        table = self.tables[shard].slice(local, 1)
        return {
            name: _cell(table.column(name).chunk(0), self.columns[name]) for name in (columns or list(self.columns))
        }

    def column_arrays(self, name: str):
        """Yield one flat numpy array per row of a list column (fast scans, e.g. token counts)."""
        spec = self.columns[name]
        for table in self.tables:
            for chunk in table.column(name).chunks:
                offsets = chunk.offsets.to_numpy()
                values = chunk.flatten().to_numpy(zero_copy_only=spec["dtype"] != "bool")
                base = offsets[0]
                for start, end in zip(offsets[:-1], offsets[1:]):
                    yield values[start - base : end - base]


def _cell(array, spec: dict[str, Any]):
    """The single value of a 1-row Arrow array as numpy (zero-copy) or a Python scalar."""
    shape = spec["shape"]
    if not shape:
        return array[0].as_py()
    storage = getattr(array, "storage", array)  # Array2D is an extension array over list<list<...>>
    values = storage.flatten()
    if len(shape) == 2:
        values = values.flatten()
    flat = values.to_numpy(zero_copy_only=spec["dtype"] != "bool")
    return flat.reshape(-1, shape[1]) if len(shape) == 2 else flat
