"""BENCHMARKS.md's summary table: the committed table is the rendering of benchmarks/summary.yaml and agrees with
the raw files it names, and a status is computed from every run (benchmarks/summary.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from benchmarks import summary as sm


def write_summary(tmp_path: Path, goals: list[dict], runs: dict | None = None) -> Path:
    runs = runs or {
        f"r{i}": {"what": f"run {i}", "date": "2026-11-28", "commit": "abc1234", "raw": "none"} for i in range(1, 5)
    }
    path = tmp_path / "summary.yaml"
    path.write_text(yaml.safe_dump({"runs": runs, "goals": goals}, allow_unicode=True))
    return path


def goal(settings: list[dict], threshold: dict | None = None, judge: str = "all", **extra) -> dict:
    return {
        "goal": "g",
        "section": "s",
        "settings": settings,
        "judge": judge,
        **({"threshold": threshold} if threshold else {}),
        **extra,
    }


def figures(*values, run_ids=("r1", "r2", "r3", "r4")) -> list[dict]:
    return [{"run": r, "value": v} for r, v in zip(run_ids, values)]


def test_committed_table_is_the_rendering_and_agrees_with_the_raw_files(capsys):
    assert sm.main(["--check"]) == 0, capsys.readouterr().err
    summary = sm.load()
    keyed = [f for g in summary.goals for s in g.settings for f in s.figures if f.key]
    assert keyed and not summary.errors  # the GPU figures are read from benchmarks/results/gpu_check_h100


def test_met_by_three_runs_and_missed_by_a_fourth_is_not_met(tmp_path):
    path = write_summary(
        tmp_path, [goal([{"name": "chain", "runs": figures(1.49, 1.57, 1.55, 1.35)}], {"op": ">=", "value": 1.5})]
    )
    (g,) = sm.load(path, tmp_path).goals
    assert sm.goal_status(g) == "not met (2 of 4 runs meet it)"
    path = write_summary(
        tmp_path, [goal([{"name": "chain", "runs": figures(1.51, 1.57, 1.55, 1.35)}], {"op": ">=", "value": 1.5})]
    )
    (g,) = sm.load(path, tmp_path).goals
    assert sm.goal_status(g) == "not met (3 of 4 runs meet it)"
    path = write_summary(
        tmp_path, [goal([{"name": "chain", "runs": figures(1.51, 1.57, 1.55, 1.50)}], {"op": ">=", "value": 1.5})]
    )
    (g,) = sm.load(path, tmp_path).goals
    assert sm.goal_status(g) == "met (4 of 4 runs)"


def test_any_judge_is_met_only_with_a_setting_every_run_of_which_meets_it(tmp_path):
    settings = [
        {"name": "P", "runs": figures(1.72, 1.57, run_ids=("r1", "r2"))},
        {"name": "chain", "runs": figures(1.49, 1.57, 1.35, run_ids=("r1", "r3", "r4"))},
        {"name": "tree", "runs": figures(1.2, run_ids=("r3",))},
    ]
    path = write_summary(tmp_path, [goal(settings, {"op": ">=", "value": 1.5}, "any", per_run=True)])
    (g,) = sm.load(path, tmp_path).goals
    assert sm.goal_status(g) == (
        "met with P (2 of 2); in some runs only: chain (1 of 3); in no run: 1 other setting; "
        "in 3 of the 4 runs behind these settings, one of them meets it"
    )
    settings[0]["runs"][1]["value"] = 1.49
    path = write_summary(tmp_path, [goal(settings, {"op": ">=", "value": 1.5}, "any")])
    (g,) = sm.load(path, tmp_path).goals
    assert sm.goal_status(g).startswith("not met in every run of any setting; in some runs only: P (1 of 2)")


def test_a_range_value_meets_only_if_both_ends_do_and_the_shown_range_covers_every_run(tmp_path):
    runs = [{"run": "r1", "value": 1.04}, {"run": "r2", "value": [0.90, 0.96]}, {"run": "r3", "value": 1.15}]
    path = write_summary(tmp_path, [goal([{"name": "grid", "unit": "×", "runs": runs}], {"op": ">", "value": 1.0})])
    (g,) = sm.load(path, tmp_path).goals
    assert sm.goal_status(g) == "not met (2 of 3 runs meet it)"
    assert sm.setting_text(g.settings[0]) == "grid: 1.04×, 0.90–0.96×, 1.15× (3 runs: 0.90–1.15×)"


def test_grouped_and_unjudged_settings(tmp_path):
    settings = [
        {"name": "300", "group": "bf16", "decimals": 3, "runs": figures(0.919, 0.939)},
        {"name": "300", "group": "fp32", "decimals": 3, "runs": figures(1.040, 0.985)},
        {"name": "context", "judged": False, "runs": figures(9.0)},
    ]
    path = write_summary(tmp_path, [goal(settings, {"op": "<=", "value": 1.03})])
    (g,) = sm.load(path, tmp_path).goals
    assert sm.goal_status(g) == "bf16: met (2 of 2 runs); fp32: not met (1 of 2 runs meets it)"
    path = write_summary(tmp_path, [goal([{"name": "GPU", "runs": []}, settings[2]], {"op": ">=", "value": 1.3})])
    (g,) = sm.load(path, tmp_path).goals
    assert sm.goal_status(g) == "unmeasured"


def test_a_figure_that_disagrees_with_its_raw_file_fails_the_check(tmp_path, capsys):
    (tmp_path / "results.json").write_text(json.dumps({"rows": [{"name": "a", "x": 1.204}, {"name": "b", "x": 2.0}]}))
    runs = {"gpu": {"what": "w", "date": "d", "commit": "c", "raw": "results.json"}}
    key = ["rows", {"name": "a"}, "x"]
    good = write_summary(
        tmp_path,
        [goal([{"name": "s", "runs": [{"run": "gpu", "key": key, "value": 1.20}]}], {"op": ">=", "value": 1.5})],
        runs,
    )
    bench = tmp_path / "BENCHMARKS.md"
    bench.write_text(f"# B\n\n{sm.BEGIN_PREFIX} -->\n{sm.END}\n\nrest\n")
    args = ["--summary", str(good), "--benchmarks", str(bench), "--root", str(tmp_path)]
    assert sm.main(args) == 0 and sm.main([*args, "--check"]) == 0
    assert "rest" in bench.read_text() and "1.20" in bench.read_text()
    bench.write_text(bench.read_text().replace("not met (0 of 1 run meets it)", "met"))
    assert sm.main([*args, "--check"]) == 1  # a hand edit of the table
    write_summary(
        tmp_path,
        [goal([{"name": "s", "runs": [{"run": "gpu", "key": key, "value": 1.30}]}], {"op": ">=", "value": 1.5})],
        runs,
    )
    assert sm.main([*args, "--check"]) == 1
    assert "1.3 in summary.yaml, 1.204 in results.json rows[name=a].x" in capsys.readouterr().err
    # a figure may leave its value to the raw file
    write_summary(
        tmp_path,
        [goal([{"name": "s", "runs": [{"run": "gpu", "key": "rows[1].x"}]}], {"op": ">=", "value": 1.5})],
        runs,
    )
    (g,) = sm.load(good, tmp_path).goals
    assert g.settings[0].figures[0].value == 2.0 and sm.goal_status(g) == "met (1 of 1 run)"


def test_a_run_whose_raw_file_is_expected_later_is_left_out_until_it_exists(tmp_path):
    runs = {
        "old": {"what": "w", "date": "d", "commit": "c", "raw": "none"},
        "new": {"what": "w", "date": "d", "commit": "c", "raw": "demo/results.json", "when_present": True},
    }
    settings = [
        {
            "name": "sps",
            "unit": "×",
            "runs": [{"run": "old", "value": 1.23}, {"run": "new", "key": ["speedup_vs_ar", "sps"]}],
        }
    ]
    path = write_summary(tmp_path, [goal(settings, {"op": ">", "value": 1.0})], runs)
    (g,) = sm.load(path, tmp_path).goals
    assert [f.run for f in g.settings[0].figures] == ["old"]
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "results.json").write_text(json.dumps({"speedup_vs_ar": {"sps": 0.97}}))
    (g,) = sm.load(path, tmp_path).goals
    assert sm.goal_status(g) == "not met (1 of 2 runs meets it)"


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"goals": []}, "expected a mapping with 'runs'"),
        (
            {
                "runs": {},
                "goals": [goal([{"name": "s", "runs": [{"run": "nope", "value": 1}]}], {"op": ">=", "value": 1})],
            },
            "unknown run 'nope'",
        ),
        ({"runs": {}, "goals": [goal([], {"op": ">=", "value": 1}, status="met")]}, "its status is computed"),
        ({"runs": {}, "goals": [goal([])]}, "needs a stated 'status'"),
        ({"runs": {}, "goals": [goal([], {"op": "=>", "value": 1})]}, "threshold needs op"),
        ({"runs": {"r": {"what": "w", "date": "d", "commit": "c"}}, "goals": []}, "missing raw"),
    ],
)
def test_a_malformed_summary_is_refused_in_one_line(tmp_path, doc, message):
    path = tmp_path / "summary.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(sm.SummaryError, match=message):
        sm.load(path, tmp_path)
