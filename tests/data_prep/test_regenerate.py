"""Batched regeneration: continuous batching equals one-prompt AR, the JSONL output, resume after kill -9,
and the disjoint GSM-symbolic train/eval seeds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_targets import save_tiny_target

from core.prompts import GSM_TRAIN_SEED, load_prompts, render_prompt
from data_prep.regenerate import main, parse_args, regenerate
from inference.algorithms import build_algorithm
from inference.batched_generation import ContinuousBatcher, Job
from inference.drafters import eos_token_ids, load_lm
from inference.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("tiny") / "target")


@pytest.fixture(scope="module")
def target(tiny):
    return load_lm(str(tiny), device="cpu", max_seq_len=96, max_batch_size=3)


def prompts_file(path: Path, n: int) -> Path:
    lines = [{"id": f"p{i}", "prompt": f"Question {i}: " + "why " * (i % 4)} for i in range(n)]
    lines[2] = {
        "id": "p2",
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "old"},
            {"role": "user", "content": "Again?"},
        ],
    }
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def run_batched(target, jobs: list[Job], batch_size: int, sampling: SamplingParams, eos=()) -> dict:
    queue, answers = list(jobs), {}
    batcher = ContinuousBatcher(target.runner, batch_size=batch_size, eos_ids=eos, sampling=sampling)
    batcher.run(lambda: queue.pop(0) if queue else None, lambda job, tokens: answers.__setitem__(job.key, tokens))
    return answers


@pytest.mark.parametrize("spare_rows", [True, False], ids=["prefill-apart", "prefill-in-place"])
def test_continuous_batching_equals_one_prompt_ar(tiny, target, spare_rows):
    """7 prompts of different lengths and budgets through 3 rows (refills mid-flight) = AR run one by one, both
    with spare rows for the prompts' prefill and with each prompt prefilled in its own row."""
    if spare_rows:
        target = load_lm(str(tiny), device="cpu", max_seq_len=96, max_batch_size=6)
    ids = [render_prompt(target.tokenizer, [{"role": "user", "content": "x " * (3 * i + 1)}]) for i in range(7)]
    jobs = [Job(i, ids[i], max_new_tokens=4 + 3 * (i % 3)) for i in range(7)]
    greedy = SamplingParams(0.0)
    batched = run_batched(target, jobs, 3, greedy)
    assert (target.runner.max_batch_size >= 6) == spare_rows
    ar = build_algorithm("ar", target.runner)
    for job in jobs:
        expected = ar.generate(list(job.ids), max_new_tokens=job.max_new_tokens, sampling=greedy).tokens
        assert batched[job.key] == expected, job.key
    # An end-of-sequence id stops a row early; the stop token is part of the answer.
    stop = batched[0][1]
    early = run_batched(target, jobs[:1], 3, greedy, eos=[stop])
    assert early[0] == batched[0][: batched[0].index(stop) + 1]


def test_sampled_jobs_do_not_depend_on_batching(target):
    ids = [render_prompt(target.tokenizer, [{"role": "user", "content": f"tell {i}"}]) for i in range(4)]
    jobs = [Job(i, ids[i], max_new_tokens=6, seed=100 + i) for i in range(4)]
    sampling = SamplingParams(1.0)
    one, three = run_batched(target, jobs, 1, sampling), run_batched(target, jobs, 3, sampling)
    assert one == three
    assert run_batched(target, [Job(0, ids[0], 6, seed=7)], 1, sampling)[0] != one[0]  # the seed matters


def test_batcher_refuses_jobs_that_do_not_fit(target):
    batcher = ContinuousBatcher(target.runner, batch_size=2, eos_ids=[], sampling=SamplingParams(0.0))
    jobs = [Job("long", [1] * 90, max_new_tokens=10)]
    with pytest.raises(ValueError, match="needs 101 cache slots but max_seq_len=96"):
        batcher.run(lambda: jobs.pop() if jobs else None, lambda job, tokens: None)
    with pytest.raises(ValueError, match="max_batch_size"):
        ContinuousBatcher(target.runner, batch_size=4, eos_ids=[], sampling=SamplingParams(0.0))


def read_jsonl(path: Path) -> tuple[dict, list[dict]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return lines[0], lines[1:]


def test_regenerate_writes_the_targets_answers_in_source_order(tiny, target, tmp_path):
    source = prompts_file(tmp_path / "prompts.jsonl", 6)
    out = tmp_path / "regen.jsonl"
    argv = [
        f"target={tiny}",
        f"source=jsonl:{source}",
        "n_samples=6",
        "max_len=80",
        "max_new_tokens=7",
        "batch_size=3",
        "device=cpu",
        f"out={out}",
    ]
    summary = regenerate(parse_args(argv), target=target)
    header, records = read_jsonl(out)
    assert header["spectrain_regenerate"]["settings"]["max_new_tokens"] == 7
    assert header["spectrain_regenerate"]["exactness"]["path"] == "exact"  # batched CPU rows: AR's answers
    assert [r["source_index"] for r in records] == list(range(6)) and summary["conversations"] == 6
    eos = eos_token_ids(target.tokenizer, target.model.config)
    ar = build_algorithm("ar", target.runner)
    for record in records:
        turns = record["messages"]
        assert turns[-1]["role"] == "assistant"
        prompt = render_prompt(target.tokenizer, turns[:-1])
        tokens = ar.generate(prompt, max_new_tokens=7, sampling=SamplingParams(0.0), eos_ids=eos).tokens
        tokens = tokens[:-1] if tokens and tokens[-1] in eos else tokens
        assert turns[-1]["content"] == target.tokenizer.decode(tokens, skip_special_tokens=True)
    # Multi-turn: the second user turn is answered after (and conditioned on) the target's own first answer.
    multi = records[2]["messages"]
    assert [t["role"] for t in multi] == ["user", "assistant", "user", "assistant"] and multi[1]["content"] != "old"
    # Every jsonl consumer reads it (the settings line is skipped).
    assert [c.id for c in load_prompts(f"jsonl:{out}")] == [f"p{i}" for i in range(6)]
    # Done: a re-run answers nothing; other settings are refused in one line before any model loads.
    assert regenerate(parse_args(argv), target=target)["new_tokens"] == 0
    with pytest.raises(ValueError, match="other settings .*max_new_tokens=7, now 8"):
        regenerate(parse_args([*argv[:-1], "max_new_tokens=8", f"out={out}"]), target=target)


def test_regenerate_cli_errors(tmp_path, capsys):
    assert main(["source=sharegpt"]) == 2
    assert "out=FILE.jsonl is required" in capsys.readouterr().err
    assert main([f"out={tmp_path}"]) == 2
    assert "is a directory" in capsys.readouterr().err
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"prompt": "not ours"}\n')
    assert main(["target=/nonexistent", f"out={foreign}"]) == 2
    assert "not a data_prep.regenerate output" in capsys.readouterr().err


def test_regenerate_resumes_after_kill_9(tiny, target, tmp_path):
    """kill -9 mid-run, then the same command: every conversation exactly once, equal to an uninterrupted run."""
    source = prompts_file(tmp_path / "prompts.jsonl", 16)
    common = [
        f"target={tiny}",
        f"source=jsonl:{source}",
        "n_samples=16",
        "max_len=90",
        "max_new_tokens=32",
        "batch_size=2",
        "device=cpu",
    ]
    reference = tmp_path / "reference.jsonl"
    regenerate(parse_args([*common, f"out={reference}"]), target=target)

    out = tmp_path / "killed.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "data_prep.regenerate", *common, f"out={out}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 4):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    written = len(out.read_text().splitlines()) - 1
    assert 3 <= written < 16, f"the kill should land mid-run ({written} conversations written)"
    with open(out, "a") as handle:  # a torn last line, as a kill during a write leaves
        handle.write('{"id": "p9", "source_ind')
    regenerate(parse_args([*common, f"out={out}"]), target=target)
    assert read_jsonl(out)[1] == read_jsonl(reference)[1]


def test_two_process_merge_waits_for_parts_finished_for_this_run(target, tiny, tmp_path, monkeypatch, capsys):
    """A 2-process run of 4 conversations whose rank 0 died before merging leaves rank 1's part and its done
    marker; a 1-process run into them is refused; re-run with n_samples=8, rank 0 must not merge that stale part but
    wait for rank 1's new one. The ranks run here in turn (they coordinate only through files); rank 1 finishes while
    rank 0 waits."""
    from data_prep import regenerate as module

    source = prompts_file(tmp_path / "prompts.jsonl", 8)
    common = [
        f"target={tiny}",
        f"source=jsonl:{source}",
        "max_len=80",
        "max_new_tokens=5",
        "batch_size=2",
        "device=cpu",
    ]
    reference, out = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    regenerate(parse_args([*common, "n_samples=8", f"out={reference}"]), target=target)

    def as_rank(rank: int, n: int) -> None:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        regenerate(parse_args([*common, f"n_samples={n}", f"out={out}"]), target=target)

    as_rank(1, 4)  # the earlier run: rank 1 finished; rank 0 never merged
    assert module.done_marker(module.part_file(out, 1, 2)).is_file()
    capsys.readouterr()
    with monkeypatch.context() as alone:  # one process into those parts: refused in one line, before any work
        alone.delenv("RANK")
        alone.delenv("WORLD_SIZE")
        assert module.main([*common, "n_samples=8", f"out={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds the unfinished parts of a 2-process run, this is a 1-process run" in err
    waited = []

    def rank_1_finishes_meanwhile(done, what: str) -> None:
        waited.append(done())
        if not done():
            as_rank(1, 8)
        assert done()

    monkeypatch.setattr(module, "wait_for", rank_1_finishes_meanwhile)
    as_rank(0, 8)
    assert waited == [False]  # the stale marker was not taken for this run's
    assert out.read_text() == reference.read_text()  # every conversation, once, in source order
    assert not list(tmp_path.glob("two.jsonl.rank-*"))


def test_gsm_training_prompts_never_meet_evaluation_prompts():
    evaluation = load_prompts("gsm_symbolic", n=60)
    training = load_prompts("gsm_symbolic_train", n=60)
    assert {c.first_user_message for c in evaluation}.isdisjoint(c.first_user_message for c in training)
    assert all(c.id.startswith(f"gsm_symbolic/{GSM_TRAIN_SEED}/") for c in training)
    assert load_prompts("gsm_symbolic_train", n=3, seed=5)[0].id == f"gsm_symbolic/{GSM_TRAIN_SEED + 5}/0"
    with pytest.raises(ValueError, match="reaches the training seeds"):
        load_prompts("gsm_symbolic", n=10, seed=GSM_TRAIN_SEED - 5)
