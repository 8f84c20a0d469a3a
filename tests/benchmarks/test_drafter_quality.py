"""benchmarks/drafter_quality.py: every stage is a command its CLI accepts, SpecBlock gets EAGLE-3's wall time,
and the goal table reads the evaluate run it says it reads."""

from __future__ import annotations

import importlib
import json

import pytest
from demo_parsers import PARSERS
from tiny_targets import save_tiny_target

from benchmarks import drafter_quality as dq
from benchmarks.draft_agreement import AgreementConfig, agreement
from core.overrides import parse_cli
from spectrain.pipeline import Stage

CLIS = {
    **PARSERS,
    "data_prep.regenerate": lambda argv: importlib.import_module("data_prep.regenerate").parse_args(argv),
    **{
        name: importlib.import_module(name).parse_args
        for name in ("benchmarks.train_step", "benchmarks.hsd_block_efficiency", "benchmarks.draft_agreement")
    },
}


@pytest.mark.parametrize("setting", dq.SETTINGS)
def test_every_stage_is_a_command_its_cli_accepts(tmp_path, setting):
    cfg = parse_cli([f"out={tmp_path}", f"setting={setting}"], dq.QualityConfig, dq.USAGE)
    stages = (dq.gsm_stages if setting == "gsm" else dq.general_stages)(cfg)
    assert stages[0].name == "regenerate" and "evaluate" in [s.name for s in stages]
    for stage in stages:
        CLIS[stage.argv[0]](list(stage.argv[1:]))
        if stage.argv[0] == "benchmarks.train_step":  # each recipe it times, with the overrides it passes
            recipes = stage.argv[1].split("=", 1)[1].strip("[]").split(",")
            for recipe in recipes:
                PARSERS["spectrain.fit"](
                    [f"recipe={recipe}", *(a for a in stage.argv[2:] if a.startswith(("data.", "trainer.")))]
                )
    groups = [s.group for s in stages if s.group]
    assert groups.count("train") == 2  # gsm: draft LM beside EAGLE-3; general: the regenerated beside the raw arm


def test_general_raw_arm_trains_on_as_many_answer_tokens(tmp_path, monkeypatch):
    cfg = parse_cli([f"out={tmp_path}", "setting=general", "eagle3_steps=100"], dq.QualityConfig, dq.USAGE)
    assert "trainer.max_steps=100" in next(s for s in dq.general_stages(cfg) if s.name == "train-eagle3-raw").argv
    # once regenerated: regenerated samples hold 150 answer tokens, raw ones 200 -> 75 raw steps
    monkeypatch.setattr(dq, "answer_tokens", lambda source, n, max_len: 150.0 if source.startswith("jsonl:") else 200.0)
    Stage("regenerate", 0, "", (), tmp_path, tmp_path / "general" / ".done" / "regenerate").mark_done(1.0)
    stages = {s.name: s for s in dq.general_stages(cfg)}
    raw, regenerated = stages["train-eagle3-raw"].argv, stages["train-eagle3"].argv
    assert "trainer.max_steps=75" in raw and "trainer.max_steps=100" in regenerated
    assert "run_name=eagle3_smollm2_raw" in raw and "data.source=sharegpt" in raw
    assert [a for a in raw if a.startswith("data.max_len")] == [a for a in regenerated if a.startswith("data.max_len")]


@pytest.mark.parametrize(("setting", "steps"), [("gsm", 480), ("general", 200)])
def test_each_setting_has_its_own_eagle3_budget_unless_given(tmp_path, setting, steps):
    stages = {"gsm": dq.gsm_stages, "general": dq.general_stages}[setting]
    for argv, expected in (([], steps), (["eagle3_steps=7"], 7)):
        cfg = parse_cli([f"out={tmp_path}", f"setting={setting}", *argv], dq.QualityConfig, dq.USAGE)
        assert f"trainer.max_steps={expected}" in next(s for s in stages(cfg) if s.name == "train-eagle3").argv


def test_general_goal_table_compares_regenerated_with_raw(tmp_path):
    out = tmp_path / "general"
    for name, tau in (("eval", 2.2), ("eval_raw", 1.6)):
        (out / name).mkdir(parents=True)
        (out / name / "results.json").write_text(
            json.dumps({"runs": [_record("ar", 1.0, 1.0), _record("eagle3_tree", tau, 0.5)]})
        )
    Stage(
        "train-eagle3", 0, "", ("spectrain.fit", "trainer.max_steps=100"), out, out / ".done" / "train-eagle3"
    ).mark_done(9.0)
    Stage(
        "train-eagle3-raw", 0, "", ("spectrain.fit", "trainer.max_steps=75"), out, out / ".done" / "train-eagle3-raw"
    ).mark_done(9.0)
    rows = {figure: (measured, met) for figure, _, measured, met in dq.goal_rows("general", out)}
    assert rows["MT-Bench: EAGLE-3 τ (default tree)"] == ("2.20", "yes")
    assert rows["MT-Bench: EAGLE-3 τ trained on regenerated ÷ on raw ShareGPT answers (equal answer tokens)"] == (
        "1.38 (τ 2.20 vs 1.60; 100 vs 75 steps)",
        "yes",
    )


def test_general_dflash_gets_eagle3s_wall_time_on_the_same_conversations(tmp_path):
    cfg = parse_cli([f"out={tmp_path}", "setting=general", "eagle3_steps=120"], dq.QualityConfig, dq.USAGE)
    stages = {s.name: s for s in dq.general_stages(cfg)}
    assert "trainer.max_steps=120" in stages["train-dflash"].argv  # no probe yet: EAGLE-3's steps
    probe = tmp_path / "general" / "step_seconds.json"
    probe.parent.mkdir(parents=True)
    probe.write_text(json.dumps({"eagle3": 10.0, "dflash": 12.5}))
    stages = {s.name: s for s in dq.general_stages(cfg)}
    dflash, eagle = stages["train-dflash"].argv, stages["train-eagle3"].argv
    assert "trainer.max_steps=96" in dflash and "recipe=dflash_smollm2" in dflash
    data = [a for a in eagle if a.startswith("data.")]
    assert data == [a for a in dflash if a.startswith("data.")] and any("regenerated.jsonl" in a for a in data)
    assert [a for a in stages["probe-step-time"].argv if a.startswith("data.")] == data  # timed on that data
    evaluate = stages["evaluate"].argv
    assert any(a.startswith("drafter.dflash=") for a in evaluate) and "dflash" in evaluate[-2]
    assert [a for a in stages["evaluate-raw"].argv if a.startswith("algorithms=")] == [
        "algorithms=[eagle3_tree,eagle3_tree@tree_depth=5@tree_topk=1@tree_total=6]"
    ]


def test_general_goal_table_puts_dflash_beside_eagle3(tmp_path):
    out = tmp_path / "general"
    (out / "eval").mkdir(parents=True)
    chain = "eagle3_tree@tree_depth=5@tree_topk=1@tree_total=6"
    runs = [
        _record("ar", 1.0, 1.0),
        _record("eagle3_tree", 2.2, 1.1),
        _record(chain, 1.9, 1.3),
        _record("dflash", 1.8, 1.4, draft_forwards=50, target_forwards=56, n_prompts=6),
    ]
    (out / "eval" / "results.json").write_text(json.dumps({"runs": runs}))
    for name, steps in (("train-eagle3", 120), ("train-dflash", 96)):
        Stage(name, 0, "", ("spectrain.fit", f"trainer.max_steps={steps}"), out, out / ".done" / name).mark_done(9.0)
    rows = {figure: (goal, measured, met) for figure, goal, measured, met in dq.goal_rows("general", out)}
    assert rows[
        "MT-Bench: DFlash beside EAGLE-3 at equal training wall time, τ and tokens/s ÷ AR (training steps)"
    ] == ("reported", f"eagle3_tree τ 2.20, 1.10×; {chain} τ 1.90, 1.30×; dflash τ 1.80, 1.40× (96 vs 120 steps)", "–")
    assert rows["MT-Bench: DFlash τ (engine, chain of block − 1)"] == ("reported", "1.80", "–")  # no GSM goal here
    assert rows["MT-Bench: DFlash drafter forwards per verification"] == ("1", "1.00", "yes")
    assert rows["MT-Bench: DFlash tokens/s ÷ the fastest EAGLE-3 setting's"] == ("reported", f"1.08 (vs {chain})", "–")
    assert rows["greedy output = AR in every run"] == ("yes", "yes", "yes")


def test_specblock_gets_eagle3s_wall_time_from_the_probe(tmp_path):
    cfg = parse_cli([f"out={tmp_path}", "eagle3_steps=120"], dq.QualityConfig, dq.USAGE)
    probe = tmp_path / "gsm" / "step_seconds.json"
    probe.parent.mkdir(parents=True)
    probe.write_text(json.dumps({"eagle3": 10.0, "specblock": 25.0}))
    specblock = next(s for s in dq.gsm_stages(cfg) if s.name == "train-specblock")
    assert "trainer.max_steps=48" in specblock.argv and dq.equal_time_steps(120, probe) == 48
    dflash = next(s for s in dq.gsm_stages(cfg) if s.name == "train-dflash")
    assert "trainer.max_steps=120" in dflash.argv  # a probe without DFlash's time gives EAGLE-3's steps
    probe.write_text(json.dumps({"eagle3": 10.0, "specblock": 25.0, "dflash": 15.0}))
    dflash = next(s for s in dq.gsm_stages(cfg) if s.name == "train-dflash")
    assert "trainer.max_steps=80" in dflash.argv and "recipe=dflash_smollm2_gsm" in dflash.argv


def test_peagle_gets_eagle3s_wall_time_from_its_own_probe(tmp_path):
    cfg = parse_cli([f"out={tmp_path}", "eagle3_steps=120"], dq.QualityConfig, dq.USAGE)
    probe = tmp_path / "gsm" / "step_seconds.json"
    probe.parent.mkdir(parents=True)
    probe.write_text(json.dumps({"eagle3": 10.0, "specblock": 25.0, "dflash": 15.0}))
    stages = {s.name: s for s in dq.gsm_stages(cfg)}
    assert "trainer.max_steps=120" in stages["train-peagle"].argv  # no P-EAGLE probe yet: EAGLE-3's steps
    assert "recipe=[eagle3_smollm2_gsm,peagle_smollm2_gsm]" in stages["probe-step-time-peagle"].argv
    (tmp_path / "gsm" / "step_seconds_peagle.json").write_text(json.dumps({"eagle3": 12.0, "peagle": 9.0}))
    stages = {s.name: s for s in dq.gsm_stages(cfg)}
    assert (
        "trainer.max_steps=160" in stages["train-peagle"].argv and "trainer.max_steps=80" in stages["train-dflash"].argv
    )
    assert "peagle" in stages["evaluate-peagle"].argv[3] and "dflash" in stages["evaluate-peagle"].argv[3]


def _record(algorithm: str, tau: float, speedup: float, **extra) -> dict:
    return {
        "algorithm": algorithm,
        "bench": "gsm_symbolic",
        "tau": tau,
        "speedup_vs_ar": speedup,
        "tokens_per_s": 10.0 * speedup,
        "draft_forwards": 10,
        "target_forwards": 10,
        "rollback_rate": 0.5,
        "acceptance_by_position": [0.7, 0.6],
        "greedy_equal_to_ar": True,
        **extra,
    }


def test_goal_table_reads_the_evaluate_run(tmp_path):
    out = tmp_path / "gsm"
    (out / "eval").mkdir(parents=True)
    v = dq.DRAFT_VOCAB
    runs = [
        _record("ar", 1.0, 1.0),
        _record(f"sps@draft_vocab={v}", 2.5, 1.6),
        _record(f"pearl@draft_vocab={v}@executor=multiprocess", 2.0, 1.2),
        _record(f"specbranch@draft_vocab={v}@executor=multiprocess", 2.1, 1.3, rollback_rate_speculated=0.25),
        _record(f"ssd@draft_vocab={v}", 2.5, 0.9, cache_hit_rate=0.4),
        _record(f"ssd@draft_vocab={v}@{dq.SSD_REFERENCE}", 2.5, 0.7, cache_hit_rate=0.65),
        _record(f"ssd@draft_vocab={v}@{dq.SSD_REFERENCE}@executor=multiprocess", 2.5, 1.2, cache_hit_rate=0.64),
        _record("eagle3_tree", 3.2, 1.1),
    ]
    (out / "eval" / "results.json").write_text(json.dumps({"runs": runs}))
    (out / "eval_specblock").mkdir()  # SpecBlock beside EAGLE-3 in a run of their own (its τ differs from above's)
    blocks = [
        _record("ar", 1.0, 1.0),
        _record("eagle3_tree", 3.0, 0.4),
        _record("specblock_tree", 2.82, 0.2, draft_forwards=4),
    ]
    (out / "eval_specblock" / "results.json").write_text(json.dumps({"runs": blocks}))
    Stage("train-eagle3", 0, "", (), out, out / ".done" / "train-eagle3").mark_done(30.0)
    Stage("train-specblock", 0, "", (), out, out / ".done" / "train-specblock").mark_done(29.0)
    rows = {figure: (measured, met) for figure, _, measured, met in dq.goal_rows("gsm", out)}
    assert rows["GSM: EAGLE-3 τ (default tree 6/8/48)"] == ("3.20", "yes")
    assert rows["GSM: best learned drafter tokens/s ÷ AR"] == (f"1.60× (sps@draft_vocab={v})", "yes")
    assert rows["GSM: draft LM top-1 agreement (first draft token of a round accepted, greedy)"] == ("0.70", "yes")
    assert rows["GSM: SpecBlock tokens/s ÷ EAGLE-3 tokens/s, each at its fastest setting"] == (
        "0.50 (specblock_tree 2.0 vs eagle3_tree 4.0)",
        "no",
    )
    assert rows["GSM: SpecBlock τ ÷ EAGLE-3 τ at equal training wall time (default trees)"] == (
        "0.94 (τ 2.82 vs 3.00)",
        "–",
    )
    assert rows["GSM: SSD cache hit rate (T = 0)"] == ("0.40", "no")
    assert rows["GSM: SSD cache hit rate (T = 0), the reference's shape (K = 7, uniform F = 3, B = 24)"] == (
        "0.65 (0.70× AR in one process)",
        "yes",
    )
    assert rows["GSM: SSD (reference shape, drafter in a second process) tokens/s ÷ SpS's"] == (
        "0.75 (hit rate 0.64)",
        "–",
    )
    assert rows["GSM: SpecBranch rollback (speculated) ÷ SpS's"] == ("0.50", "yes")
    assert rows["GSM: SpecBranch vs PEARL tokens/s (two processes)"] == ("13.0 vs 12.0", "yes")
    assert rows["greedy output = AR in every run"] == ("yes", "yes")
    assert "train-eagle3 30.0" in dq.goal_table("gsm", out)
    summary = {
        "gamma": 8,
        "measured": {"ratio": 1.07, "ci95": [0.95, 1.24]},
        "same_draft_exact": {"ratio": 1.02, "ci95": [1.01, 1.03]},
    }
    (out / "hsd.json").write_text(json.dumps({"summary": summary}))
    (out / "agreement.json").write_text(json.dumps({"top1_agreement": 0.55, "top_k_recall": {"1": 0.55, "4": 0.8}}))
    (out / "eval_peagle").mkdir()  # P-EAGLE beside EAGLE-3 in one more run: reported, no goal but one forward
    parallel = [
        _record("ar", 1.0, 1.0),
        _record("eagle3_tree", 3.0, 0.4),
        _record("peagle", 2.5, 0.6, draft_forwards=94, target_forwards=100, n_prompts=6),
    ]
    (out / "eval_peagle" / "results.json").write_text(json.dumps({"runs": parallel}))
    rows = {figure: (measured, met) for figure, _, measured, met in dq.goal_rows("gsm", out)}
    assert rows["GSM: P-EAGLE τ (engine, chain of K)"] == ("2.50", "–")
    assert rows["GSM: P-EAGLE drafter forwards per verification"] == ("1.00", "yes")
    assert rows["GSM: P-EAGLE tokens/s ÷ the fastest EAGLE-3 setting's"] == ("1.50 (vs eagle3_tree)", "–")
    assert rows["GSM: draft LM top-1 agreement with the target (held-out, teacher-forced on AR's answers)"] == (
        "0.55 (top-4 recall 0.80; a round's first draft token accepted: 0.70)",
        "no",
    )
    assert rows["GSM: HSD (capped) ÷ tokenwise block efficiency, T = 1, γ = 8"] == (
        "same-draft exact 1.020 [95 % CI 1.010, 1.030]; measured 1.070 [0.950, 1.240]",
        "–",
    )  # straddles 1.014
    summary["same_draft_exact"]["ci95"] = [1.018, 1.046]
    summary["lossy_share_of_uncapped_gain"] = {"ratio": 0.0531}
    (out / "hsd.json").write_text(json.dumps({"summary": summary}))
    rows = {figure: (measured, met) for figure, _, measured, met in dq.goal_rows("gsm", out)}
    assert rows["GSM: HSD (capped) ÷ tokenwise block efficiency, T = 1, γ = 8"] == (
        "same-draft exact 1.020 [95 % CI 1.018, 1.046]; measured 1.070 [0.950, 1.240]; the uncapped rule's lossy "
        "share of its gain 0.053",
        "yes",
    )


def test_block_drafters_are_compared_with_the_fastest_eagle3_setting(tmp_path):
    both = {
        r["algorithm"]: r
        for r in [
            _record("ar", 1.0, 1.0),
            _record("eagle3_tree", 3.1, 0.8, draft_ms_per_round=40.0),
            _record("eagle3_tree@tree_depth=5@tree_topk=1@tree_total=6", 2.2, 1.5, draft_ms_per_round=30.0),
            _record("specblock_tree", 2.0, 1.2, draft_ms_per_round=12.0),
            _record("specblock_tree@specblock_budget=16@specblock_width=4", 1.8, 1.65, draft_ms_per_round=9.0),
            _record(
                "specblock_tree@specblock_budget=16@specblock_width=4@specblock_blocks=1",
                1.6,
                1.5,
                acceptance_by_position=[0.5, 0.25, 0.125],
            ),
            _record("dflash", 3.2, 2.0, draft_forwards=94, target_forwards=100, n_prompts=6),
        ]
    }
    (tmp_path / "exports" / "dflash").mkdir(parents=True)
    (tmp_path / "exports" / "dflash" / "metrics.json").write_text(json.dumps({"val/tau_sim": 3.25}))
    rows = {figure: (measured, met) for figure, _, measured, met in dq.block_rows(both, tmp_path)}
    chain = "eagle3_tree@tree_depth=5@tree_topk=1@tree_total=6"
    assert rows["GSM: SpecBlock tokens/s ÷ EAGLE-3 tokens/s, each at its fastest setting"] == (
        f"1.10 (specblock_tree@specblock_budget=16@specblock_width=4 16.5 vs {chain} 15.0)",
        "yes",
    )
    assert rows["GSM: SpecBlock drafting ms per round ÷ EAGLE-3's (each at its fastest setting)"] == (
        "0.30 (9.0 vs 30.0 ms)",
        "yes",
    )
    assert rows["GSM: SpecBlock drafting ms per round ÷ EAGLE-3's (default trees)"] == ("0.30 (12.0 vs 40.0 ms)", "–")
    assert rows["GSM: SpecBlock τ ÷ EAGLE-3 τ at equal training wall time (default trees)"] == (
        "0.65 (τ 2.00 vs 3.10)",
        "–",
    )
    assert rows["GSM: SpecBlock 16-node tree decomposition, τ (acceptance at depths 1–3)"] == (
        "two blocks, rank-guided widths 1.80 (0.70, 0.60); one block 1.60 (0.50, 0.25, 0.12); EAGLE-3 chain of 6 "
        "2.20 (0.70, 0.60)",
        "–",
    )
    assert "GSM: SpecBlock val τ_sim ÷ EAGLE-3's at equal trained tokens" not in rows  # no training runs here
    assert rows["GSM: DFlash τ (engine, chain of block − 1)"] == ("3.20", "yes")
    assert rows["GSM: DFlash drafter forwards per verification"] == ("1.00", "yes")
    assert rows["GSM: DFlash tokens/s ÷ the fastest EAGLE-3 setting's"] == (f"1.33 (vs {chain})", "yes")
    assert rows["GSM: DFlash val/tau_sim vs served τ"] == ("3.25 vs 3.20", "yes")


def test_scaling_reads_every_validation_and_fits_log_linear(tmp_path):
    import numpy as np

    from benchmarks.scaling import fit_log_linear, tau_at_tokens, validation_points

    first, resumed = tmp_path / "logs" / "version_0", tmp_path / "logs" / "version_1"
    first.mkdir(parents=True)
    resumed.mkdir(parents=True)
    (first / "metrics.csv").write_text("epoch,step,train/loss,val/tau_sim\n0,4,3.0,\n0,9,,1.20\n0,19,,1.35\n")
    (resumed / "metrics.csv").write_text("epoch,step,train/loss,val/tau_sim\n0,39,,1.50\n0,79,,1.65\n")
    assert validation_points(tmp_path) == [(10, 1.20), (20, 1.35), (40, 1.50), (80, 1.65)]
    tokens = np.array([1e3, 1e4, 1e5])
    a, b = fit_log_linear(tokens, 0.5 + 0.25 * np.log10(tokens))
    assert abs(a - 0.5) < 1e-9 and abs(b - 0.25) < 1e-9
    # equal trained tokens: linear in log10(tokens) between the validations around it, never extrapolated
    assert abs(tau_at_tokens(tokens, np.array([1.0, 1.5, 1.7]), 10**3.5) - 1.25) < 1e-9
    assert tau_at_tokens(tokens, np.array([1.0, 1.5, 1.7]), 2e5) is None


def test_draft_agreement_is_one_for_the_target_itself_and_less_for_another(tmp_path):
    target = str(save_tiny_target(tmp_path / "target", seed=0, layers=2))
    other = str(save_tiny_target(tmp_path / "other", seed=0, layers=2, noise=0.05))
    common = dict(target=target, n_prompts=2, max_new_tokens=12, dtype="fp32")
    same = agreement(AgreementConfig(drafter=target, out=str(tmp_path / "a.json"), **common))
    assert same["positions"] == 24 and same["top1_agreement"] == 1.0
    assert json.loads((tmp_path / "a.json").read_text())["top_k_recall"]["8"] == 1.0
    noisy = agreement(AgreementConfig(drafter=other, **common))
    assert noisy["top1_agreement"] < 1.0 and noisy["top_k_recall"]["8"] >= noisy["top1_agreement"]


def test_a_partial_run_before_the_evaluation_ends_without_an_error(tmp_path):
    cfg = parse_cli([f"out={tmp_path}", "stages=[regenerate]"], dq.QualityConfig, dq.USAGE)
    regenerate = dq.gsm_stages(cfg)[0]
    regenerate.output.parent.mkdir(parents=True)
    regenerate.output.write_text("{}\n")
    regenerate.mark_done(1.0)  # done: the pipeline skips it
    assert "the goal table comes with the evaluate stage" in dq.run(cfg)


def test_the_goal_table_says_when_specblock_was_not_measured_yet(tmp_path):
    out = tmp_path / "gsm"
    v = dq.DRAFT_VOCAB
    runs = [
        _record("ar", 1.0, 1.0),
        _record(f"sps@draft_vocab={v}", 2.5, 1.6),
        _record(f"pearl@draft_vocab={v}@executor=multiprocess", 2.0, 1.2),
        _record(f"specbranch@draft_vocab={v}@executor=multiprocess", 2.1, 1.3),
        _record(f"ssd@draft_vocab={v}", 2.5, 0.9, cache_hit_rate=0.4),
        _record("eagle3_tree", 2.0, 0.8),
    ]
    (out / "eval").mkdir(parents=True)
    (out / "eval" / "results.json").write_text(json.dumps({"runs": runs}))
    rows = {figure: (measured, met) for figure, _, measured, met in dq.goal_rows("gsm", out)}
    assert rows["GSM: SpecBlock tokens/s ÷ EAGLE-3 tokens/s, each at its fastest setting"] == (
        "not measured yet (stage evaluate-specblock)",
        "–",
    )
    assert "GSM: SpecBlock τ ÷ EAGLE-3 τ at equal training wall time (default trees)" not in rows
