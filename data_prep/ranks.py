"""Data preparation on several processes (``torchrun --nproc_per_node=N -m data_prep.extract ...``).

Process ``rank`` of ``world`` takes the source items ``i`` with ``i % world == rank``: disjoint, deterministic, and
balanced for sources whose lengths drift along the file. Each process writes and resumes its own part exactly as a
single process would (its own commit log), so killing one of them loses nothing; rank 0 waits for every part to be
complete and then writes the one final result atomically (a dataset manifest, or the regenerated JSONL).

The part names carry the process count (``rank-0-of-2``), so a re-run with another count finds the parts of the
first and is refused in one line instead of mixing two slicings.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.overrides import OverrideError
from data_prep.manifest import (
    MANIFEST_NAME,
    RANKS_DIR,
    DatasetError,
    commit_log,
    header_differences,
    header_of,
    read_manifest,
    refuse_other_args,
    write_manifest,
)

POLL_SECONDS = 0.5
PART = re.compile(r"rank-(\d+)-of-(\d+)")


def launch_rank() -> tuple[int, int]:
    """``(rank, world)`` as torchrun (or SLURM via torchrun) sets ``RANK`` / ``WORLD_SIZE``; ``(0, 1)`` alone."""
    try:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        raise OverrideError(
            f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} are not "
            "integers; launch with torchrun --nproc_per_node=N -m ..."
        ) from None
    if world < 1 or not 0 <= rank < world:
        raise OverrideError(
            f"RANK={rank} is outside WORLD_SIZE={world}; launch with torchrun --nproc_per_node=N -m ..."
        )
    return rank, world


def part_name(rank: int, world: int) -> str:
    return f"rank-{rank}-of-{world}"


def my_items(n: int, rank: int, world: int) -> list[int]:
    """The source indices process ``rank`` handles (all of them for one process)."""
    return list(range(rank, n, world))


def part_worlds(names: Iterable[str]) -> set[int]:
    """The process counts the existing part names were written with."""
    return {int(m.group(2)) for name in names if (m := PART.search(name))}


def refuse_other_world(found: set[int], world: int, where: Path, command: str) -> None:
    """One line when ``where`` holds unfinished parts of a run with another process count (1 = no parts)."""
    other = sorted(found - {world})
    if not other:
        return
    was = other[0]
    launch = f"torchrun --nproc_per_node={was} -m {command}" if was > 1 else f"python -m {command} (one process)"
    raise OverrideError(
        f"{where} holds the unfinished parts of a {was}-process run, this is a {world}-process run; "
        f"resume it with {launch}, or choose a new out="
    )


def wait_for(done: Callable[[], bool], what: str) -> None:
    """Rank 0 waits for the other processes' parts (torchrun stops every process if one of them fails)."""
    announced = False
    while not done():
        if not announced:
            print(f"[rank 0] waiting for {what}", file=sys.stderr, flush=True)
            announced = True
        time.sleep(POLL_SECONDS)


# ------------------------------------------------------------------------------------ feature / trace datasets


def part_log(rank: int, world: int) -> str:
    """A process's commit log inside the dataset directory (``data_prep.shards.ShardWriter(part=...)``)."""
    return commit_log(part_name(rank, world))


def check_dataset_parts(out: Path, world: int, command: str) -> None:
    """Refuse (one line) to continue a dataset that another process count started and did not finish."""
    if (out / MANIFEST_NAME).is_file():
        if read_manifest(out).get("complete"):
            return  # finished: any process count just reports it
        found = {1}  # an unfinished single-process dataset
    else:
        found = set()
    if (out / RANKS_DIR).is_dir():
        found |= part_worlds(p.name for p in (out / RANKS_DIR).iterdir())
    refuse_other_world(found, world, out, command)


def parts_complete(out: Path, world: int) -> bool:
    logs = [out / part_log(rank, world) for rank in range(world)]
    return all(log.is_file() and read_manifest(out, part_log(r, world)).get("complete") for r, log in enumerate(logs))


def merge_dataset_parts(out: Path, world: int) -> dict[str, Any]:
    """The one manifest of a multi-process dataset: the parts' header (identical by construction: every process
    computes it from the same arguments and target) and all their shards, process by process. Within a part's log,
    source positions count that process's own items (``my_items``)."""
    logs = [read_manifest(out, part_log(rank, world)) for rank in range(world)]
    for rank, log in enumerate(logs[1:], start=1):
        diffs = header_differences(logs[0], log)
        if diffs:  # e.g. processes that loaded the target on different devices or dtypes
            raise DatasetError(
                f"process {rank} of {world} wrote {out} with other settings than process 0 "
                f"({diffs[0]}); run every process with the same arguments"
            )
    merged = {
        **header_of(logs[0]),
        "shards": [entry for log in logs for entry in log["shards"]],
        "complete": True,
        "processes": world,
    }
    for key in ("next_source_index", "num_rows", "num_tokens", "skipped"):
        merged[key] = sum(int(log[key]) for log in logs)
    write_manifest(out, merged)
    return merged


@dataclass
class DatasetPart:
    """This process's share of a dataset directory ``out`` that ``world`` processes write (``dataset_part``)."""

    out: Path
    rank: int
    world: int

    @property
    def name(self) -> str | None:
        """The part's name (``ShardWriter(part=...)``); None for a single process, which writes ``out`` itself."""
        return part_name(self.rank, self.world) if self.world > 1 else None

    def finished(self) -> dict[str, Any] | None:
        """With several processes, the manifest of an ``out`` that is already complete (``dataset_part`` refused an
        unfinished one): nothing to load. Else None (one process lets its ShardWriter report a complete ``out``)."""
        return read_manifest(self.out) if self.world > 1 and (self.out / MANIFEST_NAME).is_file() else None

    def merged(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Rank 0 of several: the one manifest, once every process's part is complete; else ``manifest`` (this
        process's own)."""
        if self.world == 1 or self.rank != 0:
            return manifest
        wait_for(
            lambda: parts_complete(self.out, self.world), f"the other {self.world - 1} process(es) to finish {self.out}"
        )
        return merge_dataset_parts(self.out, self.world)


def dataset_part(out: Path, args: dict[str, Any], command: str) -> DatasetPart:
    """This launch's process (``launch_rank``), after refusing (one line) its own part written with other
    ``args`` and the unfinished parts of another process count (``check_dataset_parts``)."""
    rank, world = launch_rank()
    if world > 1:
        refuse_other_args(out, args, part_log(rank, world))
    check_dataset_parts(out, world, command)
    return DatasetPart(out, rank, world)
