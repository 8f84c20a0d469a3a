"""The benchmark commands the README and BENCHMARKS.md show, as (where, benchmark module, argv), for tests that
parse each with its benchmark's own parser."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "BENCHMARKS.md")
# `python -m benchmarks.NAME ...` or `python benchmarks/NAME.py ...` inside backticks (possibly over several lines)
COMMAND = re.compile(r"`([^`]*?python[0-9.]* +(?:-m +benchmarks\.\w+|benchmarks/\w+\.py)[^`]*)`", re.S)
MODULE = re.compile(r"^(?:-m +benchmarks\.(\w+)|benchmarks/(\w+)\.py)$")
ELIDED = ("...", "…")


def benchmark_commands(only: str | None = None) -> list[tuple[str, str, list[str]]]:
    """(where, module, argv) of every benchmark command the docs show (of benchmark ``only``, if given): a line
    break after a comma or bracket is no space, and an elision (``...``) is dropped."""
    found = []
    for doc in DOCS:
        text = (ROOT / doc).read_text(encoding="utf-8")
        for m in COMMAND.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            command = re.sub(r"([,\[])\n\s*", r"\1", m.group(1)).replace("\n", " ")
            words = shlex.split(command.partition("python")[2].split(" ", 1)[1])
            start = next(i for i, w in enumerate(words) if w == "-m" or w.startswith("benchmarks/"))
            width = 2 if words[start] == "-m" else 1
            name = next(g for g in MODULE.match(" ".join(words[start : start + width])).groups() if g)
            if only in (None, name):
                found.append((f"{doc}:{line}", name, [w for w in words[start + width :] if w not in ELIDED]))
    return found
