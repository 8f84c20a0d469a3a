"""Atomic writes: a killed process never leaves a half-written file or directory under the final name.

``check_output`` is what every CLI taking ``out=`` calls before any model loads, so an output location that
cannot be written fails at once instead of after the work.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from core.overrides import OverrideError


def check_output(path: str | os.PathLike, *, key: str = "out", file: bool = False) -> Path:
    """Refuse, in one line (``OverrideError``) and before any work, an output location that cannot be written:
    an existing file where a directory goes (or, with ``file=True``, a directory where a file goes), a parent
    that is a file, or a nearest existing directory without write permission. Creates nothing."""

    out = Path(path).expanduser()
    if not file and out.exists() and not out.is_dir():
        raise OverrideError(
            f"{key}={path} is an existing file, not a directory; choose a directory path (or remove the file)"
        )
    if file and out.is_dir():
        raise OverrideError(f"{key}={path} is a directory; give a file path such as {out / 'NAME'}")
    probe = out if out.is_dir() else out.parent
    while not probe.exists() and probe != probe.parent:  # exists() is False below a file (ENOTDIR)
        probe = probe.parent
    if not probe.is_dir():
        raise OverrideError(
            f"{key}={path} cannot be created: {probe} is a file, not a directory; choose another {key}="
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OverrideError(
            f"{key}={path} cannot be written: no write permission in {probe}; choose a location you can write to"
        )
    return out


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; rename it to ``final`` only if the block finishes."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_directory(new: Path, final: Path) -> None:
    """Rename the finished directory ``new`` to ``final``, replacing a ``final`` that exists. A directory cannot be
    renamed over a non-empty one, so the old ``final`` is moved aside to ``.NAME.old`` and deleted last; a kill
    between the two renames leaves no ``final`` (callers keep another copy, e.g. a step checkpoint). A ``.NAME.old``
    that an earlier kill left, whole or half-deleted, is removed first: renaming onto it would fail."""
    new, final = Path(new), Path(final)
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    new.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file and rename (POSIX-atomic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a written file should read like any other
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
