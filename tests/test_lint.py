"""The tree is lint-clean and formatted as `ruff format` writes it (line length and rules in pyproject.toml)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["core", "spectrain", "data_prep", "inference", "tests", "benchmarks"]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args, *SOURCES], cwd=ROOT, capture_output=True, text=True)


def test_ruff_check_passes():
    result = _ruff("check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_leaves_every_file_unchanged():
    result = _ruff("format", "--check")
    assert result.returncode == 0, "run `make format`:\n" + result.stdout + result.stderr
