"""The repository's tracked files, for tests that read the whole tree (docs references, machine paths)."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def tracked_files(suffixes: Sequence[str], *, exclude: Sequence[str] = ()) -> list[Path]:
    """Files git tracks (a plain walk where git is missing) whose suffix is in ``suffixes``, and the Makefile,
    except those under a folder of ``exclude`` (paths relative to the root, ending in ``/``)."""
    try:
        names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        paths = [ROOT / name for name in names.splitlines()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "runs", "outputs", "build", "dist"}
        paths = [p for p in ROOT.rglob("*") if not skip & set(p.relative_to(ROOT).parts)]
    return sorted(
        p
        for p in paths
        if p.is_file()
        and (p.suffix in suffixes or p.name == "Makefile")
        and not str(p.relative_to(ROOT)).startswith(tuple(exclude))
    )
