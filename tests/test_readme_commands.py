"""Every command the README shows for the engine, data preparation and training CLIs parses with that CLI's own
parser, as written (nothing runs and nothing loads). A placeholder recipe (``recipe=NAME``) is read as a real recipe
so that the rest of its keys are still checked; the benchmark commands have their own test
(tests/benchmarks/test_bench_cli.py)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest

from data_prep import extract, regenerate, traces
from data_prep.ngram_corpus import USAGE as NGRAM_USAGE
from data_prep.ngram_corpus import NgramCorpusConfig
from data_prep.vocab import USAGE as VOCAB_USAGE
from data_prep.vocab import VocabConfig
from core.overrides import parse_cli
from inference import evaluate
from inference.engine_args import parse_engine_cli
from inference.generate import USAGE as GENERATE_USAGE
from inference.generate import GenerateConfig
from inference.serve import config as serve_config
from spectrain import export, fit
from spectrain.adapt import replay

ROOT = Path(__file__).resolve().parent.parent
COMMAND = re.compile(r"python -m ((?:inference|data_prep|spectrain)(?:\.\w+)+)")
PLACEHOLDER_RECIPE = "eagle3_smollm2"
ELIDED = ("...", "…", "key=value")
PARSERS: dict[str, Callable[[list[str]], object]] = {
    "inference.evaluate": evaluate.parse_args,
    "inference.serve": serve_config.parse_args,
    "inference.generate": lambda argv: parse_engine_cli(argv, GenerateConfig, GENERATE_USAGE),
    "data_prep.extract": extract.parse_args,
    "data_prep.traces": traces.parse_args,
    "data_prep.regenerate": regenerate.parse_args,
    "data_prep.vocab": lambda argv: parse_cli(argv, VocabConfig, VOCAB_USAGE),
    "data_prep.ngram_corpus": lambda argv: parse_cli(argv, NgramCorpusConfig, NGRAM_USAGE),
    "spectrain.export": export.parse_args,
    "spectrain.fit": fit.compose_recipe,
    "spectrain.adapt.replay": replay.parse_args,
}


def readme_commands() -> list[tuple[int, str, list[str]]]:
    """(line, module, argv) of each CLI command in the README: a line ending in a backslash goes on on the next,
    a ``#`` comment and an elision (``...``, ``key=value``) are dropped, and inline code ends at its closing backtick."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    found = []
    for number, line in enumerate(lines, start=1):
        match = COMMAND.search(line)
        if not match:
            continue
        text, follow = line[match.start() :], number
        while text.rstrip().endswith("\\"):
            text = text.rstrip()[:-1] + " " + lines[follow].strip()
            follow += 1
        inline = line[: match.start()].count("`") % 2 == 1
        if inline:
            text = text.split("`", 1)[0]
        words = shlex.split(text, comments=True)
        # "[key=value]" marks an optional argument (parsed as written inside); "key=value" and "..." are elisions
        argv = [w[1:-1] if w.startswith("[") and w.endswith("]") else w for w in words[3:] if w not in ELIDED]
        found.append((number, match.group(1), argv))
    return found


COMMANDS = readme_commands()


def test_the_readme_shows_commands_of_every_cli_here():
    assert len(COMMANDS) >= 30, COMMANDS
    assert {module for _, module, _ in COMMANDS} == set(PARSERS)


@pytest.mark.parametrize("line, module, argv", COMMANDS, ids=[f"README:{n}" for n, _, _ in COMMANDS])
def test_every_readme_command_parses(line, module, argv):
    argv = [f"recipe={PLACEHOLDER_RECIPE}" if arg == "recipe=NAME" else arg for arg in argv]
    PARSERS[module](argv)
