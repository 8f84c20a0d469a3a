"""Data preparation on several processes: ``torchrun --nproc_per_node=2 -m data_prep.extract`` (and
``data_prep.regenerate``, ``data_prep.traces``) gives the single-process dataset (same samples, order aside); kill -9
of one process, then the same command, resumes every process with no lost or duplicated sample; a run with another
process count is refused in one line while parts are unfinished."""

from __future__ import annotations

import json
import os
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

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ranks")
    save_tiny_target(root / "target", layers=4)
    save_tiny_target(root / "draft", layers=4, noise=0.002)
    write_jsonl(root / "chats.jsonl", 64)
    return root


def torchrun(module: str, args: list[str]) -> subprocess.Popen:
    """Two real processes started by torchrun (standalone rendezvous on a free port), one thread each."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "-m", module, *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


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


def one_line_refusal(main: Callable, argv: list[str], capsys, needle: str) -> None:
    capsys.readouterr()
    assert main(argv) == 2  # a single process (this one) into a 2-process run's unfinished parts
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and needle in err, err


def samples(directory: Path) -> list[dict[str, torch.Tensor]]:
    """Every sample of a feature dataset, sorted by its tokens (the comparison is order aside)."""
    data = FeatureDataset(directory)
    rows = [data[i] for i in range(len(data))]
    return sorted(rows, key=lambda r: (r["input_ids"].tolist(), r["loss_mask"].tolist()))


def test_torchrun_extract_resumes_a_killed_process_and_equals_one_process(tiny, capsys):
    args = [f"target={tiny / 'target'}", f"source=jsonl:{tiny / 'chats.jsonl'}", "n_samples=64", "max_len=48",
            "layers=[1,3]", "dtype=fp32", "batch_size=2", "shard_size=2", "device=cpu"]
    reference, out = tiny / "feats_1", tiny / "feats_2"
    assert extract.main([*args, f"out={reference}"]) == 0
    proc = torchrun("data_prep.extract", [*args, f"out={out}"])
    kill_rank_when(proc, 1, lambda: committed_shards(out / "ranks" / "rank-1-of-2.json") >= 2)
    killed = read_manifest(out, "ranks/rank-1-of-2.json")
    assert not killed["complete"] and not (out / "manifest.json").exists()
    with pytest.raises(DatasetError, match="is unfinished: its processes' parts are in .*re-run the same torchrun"):
        FeatureDataset(out)  # no consumer reads a half-written multi-process dataset
    one_line_refusal(extract.main, [*args, f"out={out}"], capsys,
                     "holds the unfinished parts of a 2-process run, this is a 1-process run; resume it with "
                     "torchrun --nproc_per_node=2")
    finish(torchrun("data_prep.extract", [*args, f"out={out}"]))

    merged, single = read_manifest(out), read_manifest(reference)
    assert merged["complete"] and merged["processes"] == 2
    assert (merged["num_rows"], merged["num_tokens"], merged["skipped"]) == \
        (single["num_rows"], single["num_tokens"], single["skipped"])
    assert sorted(p.name for p in (out / "shards").iterdir()) == sorted(s["name"] for s in merged["shards"])
    many, one = samples(out), samples(reference)
    assert len(many) == len(one) == single["num_rows"]
    for a, b in zip(many, one):  # the same samples, each once
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for name in ("aux_hidden", "last_hidden"):  # other batch neighbours: equal up to fp32 rounding
            torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-5)


def test_torchrun_regenerate_resumes_a_killed_process_and_equals_one_process(tiny, capsys):
    prompts = tiny / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Question {i}: " + "why " * (i % 4)}) + "\n"
                               for i in range(40)))
    args = [f"target={tiny / 'target'}", f"source=jsonl:{prompts}", "n_samples=40", "max_len=80",
            "max_new_tokens=24", "batch_size=2", "device=cpu"]
    reference, out = tiny / "regen_1.jsonl", tiny / "regen_2.jsonl"
    assert regenerate.main([*args, f"out={reference}"]) == 0
    proc = torchrun("data_prep.regenerate", [*args, f"out={out}"])
    part = tiny / "regen_2.jsonl.rank-1-of-2"
    kill_rank_when(proc, 1, lambda: part.exists() and len(part.read_text().splitlines()) >= 4)
    assert not out.exists() and not (tiny / "regen_2.jsonl.rank-1-of-2.done").exists()
    one_line_refusal(regenerate.main, [*args, f"out={out}"], capsys, "holds the unfinished parts of a 2-process run")
    finish(torchrun("data_prep.regenerate", [*args, f"out={out}"]))
    assert out.read_text() == reference.read_text()  # greedy answers do not depend on batching
    assert not list(tiny.glob("regen_2.jsonl.rank-*"))


def test_torchrun_traces_equal_one_process(tiny):
    args = [f"target={tiny / 'target'}", f"drafter={tiny / 'draft'}", f"source=jsonl:{tiny / 'chats.jsonl'}",
            "n_samples=12", "gamma=4", "max_new_tokens=16", "max_seq_len=128", "device=cpu"]
    reference, out = tiny / "traces_1", tiny / "traces_2"
    assert traces.main([*args, f"out={reference}"]) == 0
    finish(torchrun("data_prep.traces", [*args, f"out={out}"]))
    merged, single = read_manifest(out), read_manifest(reference)
    assert merged["complete"] and merged["num_rows"] == single["num_rows"] > 0

    def rounds(directory: Path) -> list[tuple]:
        reader = ShardReader(directory)
        return sorted((reader.row(i)["sample_index"], reader.row(i)["round"], reader.row(i)["num_accepted"],
                       tuple(reader.row(i)["draft_tokens"].tolist())) for i in range(len(reader)))

    assert rounds(out) == rounds(reference)
