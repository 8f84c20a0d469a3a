"""Data preparation on several processes: ``torchrun --nproc_per_node=2 -m data_prep.extract`` (and
``data_prep.regenerate``, ``data_prep.traces``) gives the single-process dataset (same samples, order aside); kill -9
of one extract process, then the same command, resumes every process with no lost or duplicated sample; a run with
another process count is refused in one line while parts are unfinished. The resumed and uninterrupted runs share one
torchrun launch; only the killed run has a launch of its own. (Regenerate's parts are its output file per process:
a killed one resumes as a single process's does, ``test_regenerate.py``'s kill -9 test; its merge and refusal of
another process count are tested there in one process.)"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tiny_targets import save_tiny_target, write_jsonl

from data_prep import extract, regenerate, traces
from data_prep.features import FeatureDataset
from data_prep.manifest import DatasetError, read_manifest
from data_prep.shards import ShardReader

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ranks")
    save_tiny_target(root / "target", layers=4)
    save_tiny_target(root / "draft", layers=4, noise=0.002)
    write_jsonl(root / "chats.jsonl", 32)
    return root


def torchrun(command: list[str]) -> subprocess.Popen:
    """Two real processes started by torchrun (standalone rendezvous on a free port), one thread each, running
    ``command`` (``-m MODULE ARGS`` or a script and its arguments)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *command],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def finish(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-3000:]


def rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of torchrun's worker ``rank`` (its environment says RANK=rank)."""
    for child in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if f"RANK={rank}".encode() in environ:
            return int(child)
    return None


def kill_rank_when(proc: subprocess.Popen, rank: int, ready: Callable[[], bool]) -> None:
    """SIGKILL worker ``rank`` once ``ready()``; torchrun then stops the other worker and fails."""
    deadline = time.monotonic() + 120
    while not ready():
        assert proc.poll() is None, f"torchrun ended before the kill: {proc.stderr.read().decode()[-2000:]}"
        assert time.monotonic() < deadline, "the kill point never came"
        time.sleep(0.005)
    pid = rank_pid(proc.pid, rank)
    assert pid is not None, "worker not found"
    os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode != 0


def committed_shards(log: Path) -> int:
    try:
        return len(json.loads(log.read_text())["shards"])
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def refusal(main: Callable, argv: list[str]) -> tuple[int, str]:
    """What a single process (this one) run into a 2-process run's unfinished parts returns and prints."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue().strip()


def assert_one_line_refusal(refused: tuple[int, str], needle: str) -> None:
    code, err = refused
    assert code == 2 and err.count("\n") == 0 and needle in err, err


def samples(directory: Path) -> list[dict[str, torch.Tensor]]:
    """Every sample of a feature dataset, sorted by its tokens (the comparison is order aside)."""
    data = FeatureDataset(directory)
    rows = [data[i] for i in range(len(data))]
    return sorted(rows, key=lambda r: (r["input_ids"].tolist(), r["loss_mask"].tolist()))


def extract_args(tiny: Path) -> list[str]:
    return [
        f"target={tiny / 'target'}",
        f"source=jsonl:{tiny / 'chats.jsonl'}",
        "n_samples=32",
        "max_len=48",
        "layers=[1,3]",
        "dtype=fp32",
        "batch_size=2",
        "shard_size=2",
        "device=cpu",
    ]


def regenerate_args(tiny: Path) -> list[str]:
    return [
        f"target={tiny / 'target'}",
        f"source=jsonl:{tiny / 'prompts.jsonl'}",
        "n_samples=16",
        "max_len=80",
        "max_new_tokens=16",
        "batch_size=2",
        "device=cpu",
    ]


def traces_args(tiny: Path) -> list[str]:
    return [
        f"target={tiny / 'target'}",
        f"drafter={tiny / 'draft'}",
        f"source=jsonl:{tiny / 'chats.jsonl'}",
        "n_samples=4",
        "gamma=4",
        "max_new_tokens=16",
        "max_seq_len=128",
        "device=cpu",
    ]


@pytest.fixture(scope="module")
def launched(tiny) -> dict[str, object]:
    """The single-process reference runs; a torchrun of extract with process 1 killed mid-run, and what the kill
    left (what a single process run into the parts says included); then ONE torchrun launch (``tests/run_many.py``)
    that resumes it, regenerates and records the traces: interpreter starts are most of a small multi-process run.
    Returns what the kill left."""
    (tiny / "prompts.jsonl").write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": f"Question {i}: " + "why " * (i % 4)}) + "\n" for i in range(16))
    )
    extract_out, regen_out = tiny / "feats_2", tiny / "regen_2.jsonl"
    assert extract.main([*extract_args(tiny), f"out={tiny / 'feats_1'}"]) == 0
    assert regenerate.main([*regenerate_args(tiny), f"out={tiny / 'regen_1.jsonl'}"]) == 0
    assert traces.main([*traces_args(tiny), f"out={tiny / 'traces_1'}"]) == 0
    left: dict[str, object] = {}

    proc = torchrun(["-m", "data_prep.extract", *extract_args(tiny), f"out={extract_out}"])
    kill_rank_when(proc, 1, lambda: committed_shards(extract_out / "ranks" / "rank-1-of-2.json") >= 2)
    left["extract_part"] = read_manifest(extract_out, "ranks/rank-1-of-2.json")
    left["extract_manifest"] = (extract_out / "manifest.json").exists()
    try:
        FeatureDataset(extract_out)  # no consumer may read a half-written multi-process dataset
        left["extract_read"] = None
    except DatasetError as exc:
        left["extract_read"] = str(exc)
    left["extract_refused"] = refusal(extract.main, [*extract_args(tiny), f"out={extract_out}"])

    runs = [
        ["data_prep.extract", [*extract_args(tiny), f"out={extract_out}"]],
        ["data_prep.regenerate", [*regenerate_args(tiny), f"out={regen_out}"]],
        ["data_prep.traces", [*traces_args(tiny), f"out={tiny / 'traces_2'}"]],
    ]
    (tiny / "runs.json").write_text(json.dumps(runs))
    finish(torchrun([str(TESTS / "run_many.py"), str(tiny / "runs.json")]))
    return left


def test_torchrun_extract_resumes_a_killed_process_and_equals_one_process(tiny, launched):
    out, reference = tiny / "feats_2", tiny / "feats_1"
    assert not launched["extract_part"]["complete"] and not launched["extract_manifest"]
    assert re.search(
        "is unfinished: its processes' parts are in .*re-run the same torchrun",
        launched["extract_read"] or "it was read",
    )
    assert_one_line_refusal(
        launched["extract_refused"],
        "holds the unfinished parts of a 2-process run, this is a 1-process run; resume it with "
        "torchrun --nproc_per_node=2",
    )

    merged, single = read_manifest(out), read_manifest(reference)
    assert merged["complete"] and merged["processes"] == 2
    assert (merged["num_rows"], merged["num_tokens"], merged["skipped"]) == (
        single["num_rows"],
        single["num_tokens"],
        single["skipped"],
    )
    assert sorted(p.name for p in (out / "shards").iterdir()) == sorted(s["name"] for s in merged["shards"])
    many, one = samples(out), samples(reference)
    assert len(many) == len(one) == single["num_rows"]
    for a, b in zip(many, one):  # the same samples, each once
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for name in ("aux_hidden", "last_hidden"):  # other batch neighbours: equal up to fp32 rounding
            torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-5)


def test_torchrun_regenerate_equals_one_process(tiny, launched):
    out, reference = tiny / "regen_2.jsonl", tiny / "regen_1.jsonl"
    assert out.read_text() == reference.read_text()  # greedy answers do not depend on batching
    assert not list(tiny.glob("regen_2.jsonl.rank-*"))


def test_torchrun_traces_equal_one_process(tiny, launched):
    out, reference = tiny / "traces_2", tiny / "traces_1"
    merged, single = read_manifest(out), read_manifest(reference)
    assert merged["complete"] and merged["num_rows"] == single["num_rows"] > 0

    def rounds(directory: Path) -> list[tuple]:
        reader = ShardReader(directory)
        return sorted(
            (
                reader.row(i)["sample_index"],
                reader.row(i)["round"],
                reader.row(i)["num_accepted"],
                tuple(reader.row(i)["draft_tokens"].tolist()),
            )
            for i in range(len(reader))
        )

    assert rounds(out) == rounds(reference)
