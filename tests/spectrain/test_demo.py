"""make demo's pipeline: every stage is a valid project command, done stages are skipped, a failure is one line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from demo_parsers import PARSERS

from core.overrides import parse_cli
from spectrain import demo, pipeline
from inference.algorithms import ALGORITHMS
from inference.evaluate import parse_args as parse_evaluate, select_algorithms
from spectrain.pipeline import Stage, measured_pace, minutes_left, run_pipeline, stage_minutes


def config(tmp_path, *args: str):
    return parse_cli([f"out={tmp_path / 'demo'}", *args], demo.DemoConfig, demo.USAGE)


def test_every_stage_is_a_command_its_cli_accepts_and_evaluate_serves_all_ten_algorithms(tmp_path):
    """Every stage's argv passes its CLI's own parsing; each trained drafter reaches the exports directory evaluate
    reads, and with the kinds they export ``algorithms=all`` serves every registered algorithm (none skipped)."""
    stages = demo.build_stages(config(tmp_path))
    assert [s.name for s in stages][:2] == ["regenerate", "ngram-corpus"] and stages[-1].name == "evaluate"
    exported = {
        s.argv[1].removeprefix("ckpt="): Path(s.argv[-1].removeprefix("out="))
        for s in stages
        if s.argv[0] == "spectrain.export"
    }
    trained, available = set(), set()
    for stage in stages:
        parsed = PARSERS[stage.argv[0]](list(stage.argv[1:]))
        if stage.argv[0] == "spectrain.fit":
            trained.add(parsed.run_name)
            assert exported[str(stage.output)].parent == tmp_path / "demo" / "exports", stage.name
            available.add(parsed.kind)
            if parsed.run_name in demo.DEMO_RECIPE_STEPS:
                assert parsed.trainer.max_steps == demo.DEMO_RECIPE_STEPS[parsed.run_name]
    assert trained == {"demo_draftlm", "demo_hrad", "demo_eagle3", "demo_specblock", "demo_dflash", "demo_peagle"}
    labels, skipped = select_algorithms(parse_evaluate(list(stages[-1].argv[1:])), available)
    assert skipped == {} and set(ALGORITHMS) <= set(labels) and len(ALGORITHMS) == 10


def _mark_done(stage: demo.Stage) -> None:
    stage.output.parent.mkdir(parents=True, exist_ok=True)
    if stage.output.suffix == ".ckpt":
        stage.output.write_bytes(b"ckpt")
    else:
        stage.output.mkdir(exist_ok=True)
    stage.mark_done()


def test_finished_stages_are_skipped_and_the_table_is_printed(tmp_path, monkeypatch, capsys):
    cfg = config(tmp_path)
    stages = demo.build_stages(cfg)
    for stage in stages:
        _mark_done(stage)
    (stages[-1].output / "report.md").write_text("| algorithm | τ |\n")
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a finished stage ran again"))
    monkeypatch.setattr(demo, "probe_seconds", lambda dtype: pytest.fail("nothing to run, nothing to time"))
    demo.run_stages(cfg)
    out = capsys.readouterr().out
    assert out.count("done already") == len(stages) and "| algorithm | τ |" in out
    timings = json.loads((tmp_path / "demo" / "stage_minutes.json").read_text())
    assert [t["stage"] for t in timings] == [s.name for s in stages]


def test_a_stage_killed_midway_is_not_done(tmp_path):
    """A checkpoint or a partial dataset without the stage's marker means the command did not finish."""
    train = next(s for s in demo.build_stages(config(tmp_path)) if s.name == "train-eagle3")
    train.output.parent.mkdir(parents=True)
    train.output.write_bytes(b"half-trained")
    assert not train.done()
    train.mark_done()
    assert train.done()


def test_a_failed_stage_stops_with_one_line_and_keeps_earlier_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "probe_seconds", lambda dtype: demo.REFERENCE_PROBE_SECONDS)
    cfg = config(tmp_path, "stages=[regenerate,ngram-corpus]")
    first, _ = demo.build_stages(cfg)[:2]
    _mark_done(first)
    calls = []

    class Failing:  # a stage process that exits 1
        returncode = 1

        def __init__(self, cmd, **kwargs):
            calls.append(cmd)

        def poll(self):
            return 1

    monkeypatch.setattr(subprocess, "Popen", Failing)
    assert demo.main([f"out={tmp_path / 'demo'}", "stages=[regenerate,ngram-corpus]"]) == 2
    err = capsys.readouterr().err.strip()
    assert "demo stage ngram-corpus failed" in err and "\n" not in err
    assert len(calls) == 1 and first.done()


def test_unknown_stage_is_refused(tmp_path, capsys):
    assert demo.main([f"out={tmp_path}", "stages=[regenerate,trian]"]) == 2
    assert "unknown stage(s) ['trian']" in capsys.readouterr().err


def test_stages_of_one_group_run_side_by_side_and_the_table_prints_once(tmp_path, monkeypatch, capsys):
    events = []

    class Recording:  # starts "running" at construction, finishes (writing its output) when first polled
        returncode = 0

        def __init__(self, cmd, **kwargs):
            self.name = cmd[-1]
            events.append(("start", self.name))

        def poll(self):
            if self.name == "b" and ("polled", "b") not in events:  # b outlives c: c is recorded first
                events.append(("polled", "b"))
                return None
            (tmp_path / self.name).mkdir()
            events.append(("end", self.name))
            return 0

    def stage(name: str, group: str = "") -> Stage:
        return Stage(name, 1.0, name, ("x", name), tmp_path / name, tmp_path / ".done" / name, group)

    monkeypatch.setattr(subprocess, "Popen", Recording)
    monkeypatch.setattr("spectrain.pipeline.POLL_S", 0.0)
    stages = [stage("a"), stage("b", "train"), stage("c", "train"), stage("d")]
    assert run_pipeline(stages, label="t", rerun_hint="it") == ["a", "c", "b", "d"]  # in the order they ended
    assert events == [
        ("start", "a"),
        ("end", "a"),
        ("start", "b"),
        ("start", "c"),
        ("polled", "b"),
        ("end", "c"),
        ("end", "b"),
        ("start", "d"),
        ("end", "d"),
    ]
    assert all(s.done() and s.measured_minutes() is not None for s in stages)

    cfg = config(tmp_path / "demo_run", "stages=[evaluate]")
    evaluate = demo.build_stages(cfg)[-1]

    class Evaluating(Recording):
        def poll(self):
            evaluate.output.mkdir(parents=True)
            (evaluate.output / "report.md").write_text("| algorithm | τ |\n")
            print("| algorithm | τ |")  # what inference.evaluate prints when it finishes
            return 0

    monkeypatch.setattr(subprocess, "Popen", Evaluating)
    monkeypatch.setattr(demo, "probe_seconds", lambda dtype: demo.REFERENCE_PROBE_SECONDS)
    capsys.readouterr()
    demo.run_stages(cfg)
    assert capsys.readouterr().out.count("| algorithm | τ |") == 1


def test_the_time_left_counts_side_by_side_stages_once(tmp_path):
    stages = [
        Stage(name, minutes, name, ("x",), tmp_path / name, tmp_path / ".done" / name, group)
        for name, minutes, group in [("a", 2.0, ""), ("b", 5.0, "g"), ("c", 3.0, "g"), ("d", 1.0, "")]
    ]
    assert minutes_left(stages) == 2.0 + 5.0 + 1.0
    stages[1].output.mkdir()
    stages[1].mark_done()
    assert minutes_left(stages) == 2.0 + 3.0 + 1.0
    assert minutes_left(stages, pace=1.5) == 1.5 * (2.0 + 3.0 + 1.0)


def test_the_pace_is_the_probe_s_until_stages_have_run_then_theirs():
    assert measured_pace([], probed=1.7) == 1.7
    # wall minutes over reference minutes, pooled: a long stage weighs more than a short one
    assert measured_pace([(4.0, 10.0), (1.0, 1.0)], probed=1.7) == pytest.approx(11.0 / 5.0)
    pace, note = demo.host_pace(3 * demo.REFERENCE_PROBE_SECONDS)
    assert pace == pytest.approx(3.0) and "x3.00" in note


def test_announced_minutes_follow_the_probe_then_the_stages_measured_pace(tmp_path, monkeypatch, capsys):
    """The first announcement scales the reference minutes by the probe's pace; once a stage has finished, the
    minutes left are announced again at the pace it ran at (its wall minutes over its reference minutes)."""
    clock = iter([0.0, 6 * 60.0, 6 * 60.0, 7 * 60.0])  # stage a takes 6 min (reference 2), b takes 1 min

    class Finishing:
        returncode = 0

        def __init__(self, cmd, **kwargs):
            self.name = cmd[-1]

        def poll(self):
            (tmp_path / self.name).mkdir()
            return 0

    monkeypatch.setattr(subprocess, "Popen", Finishing)
    monkeypatch.setattr(pipeline, "time", SimpleNamespace(perf_counter=lambda: next(clock), sleep=lambda s: None))
    stages = [
        Stage(name, minutes, name, ("x", name), tmp_path / name, tmp_path / ".done" / name)
        for name, minutes in [("a", 2.0), ("b", 4.0)]
    ]
    run_pipeline(stages, label="t", rerun_hint="it", pace=2.0, pace_note="probe")
    out = capsys.readouterr().out
    assert "about 12 min of work left on this host (probe)" in out and "a (about 4.0 min)" in out
    assert "finished in 6.0 min (announced 4.0)" in out
    assert "took 3.00x their reference minutes: about 12 min of work left" in out and "b (about 12.0 min)" in out
    assert stage_minutes(stages) == [  # what the demo writes to stage_minutes.json
        {"stage": "a", "group": "", "reference_minutes": 2.0, "announced_minutes": 4.0, "minutes": 6.0},
        {"stage": "b", "group": "", "reference_minutes": 4.0, "announced_minutes": 12.0, "minutes": 1.0},
    ]
