"""No tracked code or doc names a path of one machine: a temp folder, a checkout or a home directory (a default
goes under the run's output directory, ``$SPECTRAIN_CACHE`` or ``tempfile``). Raw run records
(``benchmarks/results/``) keep the commands as they ran."""

from __future__ import annotations

import re
from pathlib import Path

from repo_files import tracked_files

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = (".py", ".sh", ".md", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".txt")
RECORDS = ("benchmarks/results/",)
# written in pieces so that this file does not match itself
MACHINE_PATH = re.compile(
    r"(?<![\w.$}-])/(?:" + "tmp|work|root|home|Users|mnt|scratch" + r")/"  # absolute machine folders
    r"|[A-Za-z]:\\" + r"\\?Users"  # a Windows home
    r"|~" + r"/(?!\.cache/spectrain)"  # a home directory other than the documented cache default
)


def machine_paths(text: str) -> list[tuple[int, str]]:
    return [(i, m.group(0)) for i, line in enumerate(text.splitlines(), 1) for m in MACHINE_PATH.finditer(line)]


def test_no_tracked_file_names_a_machine_path():
    files = tracked_files(SUFFIXES, exclude=RECORDS)
    assert any(p.name == "config.py" and p.parent.name == "benchmarks" for p in files), "the file list is wrong"
    found = [
        f"{p.relative_to(ROOT)}:{line}: {match}"
        for p in files
        for line, match in machine_paths(p.read_text(encoding="utf-8", errors="replace"))
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("text", "flagged"),
    [
        ("drafter: str = '/" + "tmp/exports/e3'", True),
        ("cd /" + "work/wt/x && make", True),
        ("out=/" + "root/out/gpu", True),
        ("see ~" + "/runs/x", True),
        ("C:\\" + "Users\\me", True),
        ("a temporary file in /tmp and shutil.move", False),
        ("dequantised into ~/.cache/spectrain", False),
        ("out=runs/x drafter=$OUT/gpu", False),
        ("benchmarks/results/tmp/x", False),
    ],
)
def test_the_check_flags_machine_paths_only(text, flagged):
    assert bool(machine_paths(text)) is flagged
