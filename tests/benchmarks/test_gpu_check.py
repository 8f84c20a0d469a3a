"""benchmarks/gpu_check: its CPU dry run fills every section with real content, and a divergence is judged by rank
and gap (the device run itself needs a GPU)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu_check


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    assert gpu_check.main([f"out={out}", "cpu_dry_run=true"]) == 0
    return json.loads((out / "results.json").read_text()), (out / "report.md").read_text()


def test_the_dry_run_records_every_section(dry_run):
    results, report = dry_run
    sections = results["sections"]
    assert list(sections) == list(gpu_check.SECTIONS)
    assert all(s["ok"] for s in sections.values()), {k: s.get("error") for k, s in sections.items()}
    env = results["environment"]
    assert env["cpu_dry_run"] and env["torch"] == torch.__version__ and env["command"].endswith("cpu_dry_run=true")
    for name in gpu_check.SECTIONS:
        assert f"## {name}" in report


def test_lossless_fp32_outputs_equal_ar_and_the_checks_ran(dry_run):
    lossless = dry_run[0]["sections"]["lossless"]
    greedy = lossless["greedy"]
    assert {r["algorithm"] for r in greedy} == set(gpu_check.ALGORITHMS) - {"ar"}
    assert {r["model"] for r in greedy} == {"tiny", "big"}
    assert all(r["equal"] for r in greedy if r["dtype"] == "fp32"), greedy
    assert lossless["summary"]["equal"] == len(greedy)
    for law in lossless["exact_law"]:
        assert law["runs"] > 0 and 0 <= law["tv"] <= 1 and 0 <= law["p_value"] <= 1
    assert {e["algorithm"] for e in lossless["executors"]} == {"pearl", "specbranch"}
    assert all(e["equal"] for e in lossless["executors"])
    assert [g["ok"] for g in lossless["generator_devices"]] == [True, True]  # ar and pearl, a CPU generator


def test_timings_and_training_are_measured(dry_run):
    sections = dry_run[0]["sections"]
    speed = sections["ar_speed"]
    assert speed["engine_tokens_per_s"] > 0 and speed["roofline_tokens_per_s"] > 0
    assert all(g["tokens_per_s"] > 0 and g["same_tokens_as_engine"] for g in speed["generate"]), speed["generate"]
    forwards = sections["verify_cost"]["forwards"]
    assert forwards and all(f["decode_ms"] > 0 and f["chain_ms"] > 0 and f["tree_ms"] > 0 for f in forwards)
    steps = sections["training"]["steps"]
    assert [s["recipe"] for s in steps] == ["eagle3_llama8b", "specblock_llama8b"]
    assert all("error" not in s and s["step_s"] > 0 and s["estimated_gib"] >= 0 for s in steps), steps
    adapter = sections["training"]["background_adapter"]
    assert adapter["all_equal_to_ar"] and adapter["serving_weights_changed"]
    assert "skipped" in sections["ar_compiled"]


def test_a_divergence_is_a_near_tie_only_for_the_runner_up_within_the_bound():
    plan = gpu_check.Plan.of(gpu_check.GpuCheckConfig(cpu_dry_run=True))
    models = gpu_check.Models(plan)
    runner = gpu_check.runner_for(models.get("tiny"), 64)
    prompt = [3, 1, 4, 1, 5]
    reference = (
        gpu_check.build_algorithm("ar", runner).generate(prompt, max_new_tokens=6, sampling=gpu_check.GREEDY).tokens
    )
    logits = gpu_check.logits_after(runner, prompt, reference[:3], stepwise=True)
    ranked = torch.argsort(logits, descending=True).tolist()
    assert ranked[0] == reference[3]
    runner_up = reference[:3] + [ranked[1]]
    gap = float(logits[ranked[0]] - logits[ranked[1]])
    near = gpu_check.divergence(runner, prompt, reference, runner_up, 3, tie=gap + 1.0)
    assert near["rank"] == 1 and near["near_tie_flip"] and near["gap"] == pytest.approx(gap, abs=1e-4)
    assert not gpu_check.divergence(runner, prompt, reference, runner_up, 3, tie=0.0)["near_tie_flip"]
    far = gpu_check.divergence(runner, prompt, reference, reference[:3] + [ranked[-1]], 3, tie=1e9)
    assert far["rank"] == len(ranked) - 1 and not far["near_tie_flip"]
    assert gpu_check.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert gpu_check.first_divergence([1, 2], [1, 2, 3]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_refuses_unless_a_dry_run(tmp_path, capsys):
    assert gpu_check.main([f"out={tmp_path}"]) == 2
    assert "cpu_dry_run=true" in capsys.readouterr().err
