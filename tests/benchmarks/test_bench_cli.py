"""The benchmark CLIs: every command the README and BENCHMARKS.md show parses with its benchmark's own parser (run
nowhere), each shared option is declared once (``benchmarks/config.py``), and an old spelling still parses."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from pathlib import Path

import pytest
from doc_commands import benchmark_commands
from omegaconf import OmegaConf

from benchmarks import config
from benchmarks.config import BenchConfig, parse_bench
from core.overrides import OverrideError
from inference.engine_args import EngineArgs

ROOT = Path(__file__).resolve().parents[2]
NOT_KEY_VALUE = {"summary"}  # argparse flags; tests/benchmarks/test_benchmarks_summary.py runs it
# importing speculators takes tens of seconds: tests/spectrain/test_speculators_interop.py, which imports it anyway,
# parses this benchmark's commands
HEAVY = {"speculators_peer"}
SHARED = {
    name
    for group in vars(config).values()
    if dataclasses.is_dataclass(group) and group.__module__ == config.__name__
    for name in group.__dataclass_fields__
}
# Shared options a benchmark restates, and why: each keeps the option's meaning but its measurement needs another
# default (or, for ssd_recall, "the evaluate run's own" in place of a fixed one; hsd_block_efficiency pools benches)
RESTATED = {
    ("drafter_quality", "max_new_tokens"),  # the README's figures were measured with 192
    ("regenerate_throughput", "n_prompts"),  # as many as the largest default batch (24)
    ("tau_context", "n_prompts"),  # a long prompt's prefill takes minutes on a CPU
    ("tau_context", "max_seq_len"),  # contexts up to SmolLM2's 8,192-token window
    ("gpu_check", "threads"),  # the device machine's CPU is not shared
    ("gpu_check", "repeats"),  # what the recorded H100 run used
    ("hsd_block_efficiency", "bench"),  # a list: several benches pooled
    ("ssd_recall", "target"),  # default: the evaluate run's
    ("ssd_recall", "dtype"),  # default: the evaluate run's
    ("exact_prefill", "repeats"),  # each run is a process that loads SmolLM2 and prefills for up to a minute
    ("exact_prefill", "max_seq_len"),  # default: each prompt's length + 16
}


def benchmark_modules() -> list[str]:
    skip = {"__init__", "config", *NOT_KEY_VALUE}
    return sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in skip)


SHOWN = benchmark_commands()
COMMANDS = [(where, name, argv) for where, name, argv in SHOWN if name not in NOT_KEY_VALUE | HEAVY]


def test_the_docs_show_commands_of_most_benchmarks():
    shown = {name for _, name, _ in SHOWN}
    assert len(SHOWN) > 50 and len(shown - NOT_KEY_VALUE) >= 18, sorted(shown)
    assert shown <= {*benchmark_modules(), *NOT_KEY_VALUE}, shown - {*benchmark_modules(), *NOT_KEY_VALUE}


@pytest.mark.parametrize(("where", "name", "argv"), COMMANDS, ids=[where for where, _, _ in COMMANDS])
def test_every_documented_command_parses(where, name, argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a default output directory is checked relative to here
    importlib.import_module(f"benchmarks.{name}").parse_args(argv)


@pytest.mark.parametrize("name", sorted(set(benchmark_modules()) - HEAVY))
def test_every_benchmark_parses_on_the_shared_base(name):
    """Each CLI has a parse-only ``parse_args`` and a schema on the shared base (or the engine's arguments)."""
    module = importlib.import_module(f"benchmarks.{name}")
    assert callable(getattr(module, "parse_args", None)), f"benchmarks/{name}.py has no parse_args"
    schemas = [obj for obj in vars(module).values() if isinstance(obj, type) and _is_schema(name, obj.__name__)]
    assert schemas, f"benchmarks/{name}.py: no config extends benchmarks.config.BenchConfig (or the engine's)"


def shared_declarations() -> set[tuple[str, str]]:
    """(benchmark, option) for every shared option a benchmark's dataclass declares itself (an annotated field)."""
    found = set()
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        if path.stem == "config":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and any("dataclass" in ast.unparse(d) for d in node.decorator_list):
                found |= {
                    (path.stem, item.target.id)
                    for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                    if item.target.id in SHARED and _is_schema(path.stem, node.name)
                }
    return found


def _is_schema(module: str, name: str) -> bool:
    """Whether class ``name`` of ``benchmarks.<module>`` is (defined there and) a CLI schema."""
    cls = getattr(importlib.import_module(f"benchmarks.{module}"), name)
    return cls.__module__ == f"benchmarks.{module}" and issubclass(cls, (BenchConfig, EngineArgs))


def test_each_shared_option_is_declared_once():
    assert shared_declarations() == RESTATED


def test_an_old_spelling_parses_with_a_warning(capsys):
    shift = importlib.import_module("benchmarks.adapt_domain_shift")
    cfg, adapt, _ = shift.parse_args(["drafter=DIR", "n=3", "adapt_buffer=2"])
    assert cfg.n_prompts == 3 and adapt == {"buffer": "2"}
    assert "n=3 is the old spelling; write n_prompts=3" in capsys.readouterr().err
    sweep = importlib.import_module("benchmarks.ssd_sweep").parse_args(["drafter=DIR", "n=5"])
    assert sweep.n_prompts == 5 and OmegaConf.get_type(sweep).__name__ == "SweepConfig"


@pytest.mark.parametrize(
    ("module", "argv", "message"),
    [
        ("ssd_sweep", [], "drafter=DIR (a draft LM) is required"),
        ("adapt_domain_shift", [], "drafter=DIR (an EAGLE-3 or SpecBlock export) is required"),
        ("adapt_domain_shift", ["drafter=DIR", "nope=1"], "unknown key 'nope'"),
        ("engine_ar", ["thread=2"], "did you mean 'threads'"),
        ("train_step", ["steps=2"], "recipe=NAME is required"),
    ],
)
def test_a_bad_command_is_refused_in_one_line(module, argv, message):
    with pytest.raises(OverrideError, match=re.escape(message)) as error:
        importlib.import_module(f"benchmarks.{module}").parse_args(argv)
    assert "\n" not in str(error.value)


def test_shared_defaults_and_the_output_directory(tmp_path):
    cfg = parse_bench([], importlib.import_module("benchmarks.draft_agreement").AgreementConfig, "usage")
    assert (cfg.threads, cfg.target, cfg.dtype, cfg.n_prompts, cfg.max_new_tokens) == (1, "smollm2", "auto", 6, 128)
    assert config.run_dir(cfg, "draft_agreement") == Path("runs/draft_agreement")
    assert config.run_dir(OmegaConf.create({"out": str(tmp_path)}), "x") == tmp_path
