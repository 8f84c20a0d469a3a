"""adapt_background: the adapter's work on a worker thread, published one query late; the policy and replay know
the lag; settings parsed from strings (the replay / benchmark command lines)."""

from __future__ import annotations

import copy

import pytest
import torch
from adapt_helpers import PROMPTS, adapter_for, forcing_settings, tiny_pair
from tiny_targets import GREEDY, runner

from inference.algorithms import build_algorithm
from spectrain.adapt.adapter import AdaptSettings
from spectrain.adapt.background import BackgroundRunner, Publisher, changed_weights
from spectrain.adapt.cost import CostModel
from spectrain.adapt.drafters import Eagle3Adaptable


@pytest.fixture(scope="module")
def tiny():
    return tiny_pair()


def state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_background_serving_stays_greedy_equal_and_publishes_one_query_late(tiny, monkeypatch):
    target, drafter = tiny
    loaded = state(drafter)
    ar = build_algorithm("ar", runner(target))
    algorithm = build_algorithm(
        "eagle3_tree",
        runner(target),
        drafter,
        tree_depth=3,
        tree_topk=3,
        tree_total=10,
        adapt="bandit",
        adapt_settings=forcing_settings(background=True),
    )
    adapter = algorithm.adapter
    serving, training = algorithm.drafter, adapter.adaptable.module
    assert training is not serving and training.embed_tokens.weight is serving.embed_tokens.weight
    # what serves each query, and what the training copy holds as each query ends (before its own work)
    served, trained = [], []
    original_process = adapter.process

    def process(record, **kw):
        row = original_process(record, **kw)
        trained.append(state(training))
        return row

    monkeypatch.setattr(adapter, "process", process)
    for prompt in PROMPTS:
        served.append(state(serving))
        assert (
            algorithm.generate(prompt, max_new_tokens=20, sampling=GREEDY).tokens
            == ar.generate(prompt, max_new_tokens=20, sampling=GREEDY).tokens
        )
    adapter.close()
    rows = adapter.log.rows
    assert len(rows) == len(PROMPTS) and {r["arm"] for r in rows} & {"head", "full"}
    assert same(served[0], served[1]) and same(served[1], state(drafter))  # job 0 ran during query 1
    assert same(served[2], trained[0]) and same(served[3], trained[1])  # query k+2 serves job k's weights
    assert not same(served[2], served[0])  # it did adapt
    assert same(state(serving), trained[-1])  # close() published the last job
    assert drafter is not serving and same(state(drafter), loaded)  # the loaded drafter: never touched


@pytest.mark.parametrize("background, rolled_back_at", [(False, 2), (True, 3)])
def test_the_policy_waits_a_query_longer_for_feedback_and_rollback_in_background(tiny, background, rolled_back_at):
    """Replay-style (no thread): after an update at query 0, the first query it serves is 1, or 2 in background;
    its feedback and the rollback watch start there."""
    target, drafter = tiny
    drafter = copy.deepcopy(drafter)
    adapter, adaptable = adapter_for(drafter, background=background, min_gap=5)
    record = adaptable.synthetic_record(24, prompt_len=6)
    record.max_accept = 7
    rows = [adapter.process(record, tau=tau, signal=1.0, iter_ratio=1.0) for tau in [2.0, 1.0, 1.0, 1.0]]
    assert [r["arm"] for r in rows] == ["head", "skip", "skip", "skip"]
    first_feedback = 2 if background else 1
    assert [r.get("prev_arm", "") for r in rows][first_feedback] == "head"
    assert all(r.get("prev_arm", "") in ("", None) for r in rows[:first_feedback])
    assert [r["rolled_back"] for r in rows] == [i == rolled_back_at for i in range(4)]


def test_publisher_copies_only_trainable_parameters_by_name(tiny):
    target, drafter = tiny
    training, serving = copy.deepcopy(drafter), copy.deepcopy(drafter)
    adaptable = Eagle3Adaptable(training)
    with torch.no_grad():
        for p in adaptable.all_parameters():
            p.add_(1.0)
    publisher = Publisher(training, serving, adaptable.all_parameters())
    assert not same(state(training), state(serving))
    publisher.publish()
    assert same(state(training), state(serving))
    assert training.embed_tokens.weight.data_ptr() != serving.embed_tokens.weight.data_ptr()
    bad = copy.deepcopy(drafter)
    bad.lm_head = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="has no parameter 'lm_head.weight'"):
        Publisher(training, bad, adaptable.all_parameters())


def test_background_runner_publishes_only_changes_and_raises_job_errors_in_the_caller(tiny):
    target, drafter = tiny
    training, serving = copy.deepcopy(drafter), copy.deepcopy(drafter)
    trainable = Eagle3Adaptable(training).all_parameters()
    runner_ = BackgroundRunner(Publisher(training, serving, trainable), torch.device("cpu"))
    assert runner_.collect() is None

    def bump(kept: bool):
        def job():
            with torch.no_grad():
                training.lm_head.weight.add_(1.0)
            return {"kept": kept, "rolled_back": False, "reset": False}

        return job

    runner_.submit(bump(False))
    with pytest.raises(RuntimeError, match="collect the running job"):
        runner_.submit(bump(True))
    assert runner_.collect() == {"kept": False, "rolled_back": False, "reset": False}
    assert not torch.equal(training.lm_head.weight, serving.lm_head.weight)  # not published: nothing "changed"
    runner_.submit(bump(True))
    runner_.wait()  # finished, not yet published: the serving drafter changes only at collect
    assert not torch.equal(training.lm_head.weight, serving.lm_head.weight)
    runner_.collect()
    assert torch.equal(training.lm_head.weight, serving.lm_head.weight)

    def broken():
        raise FloatingPointError("the update diverged")

    runner_.submit(broken)
    with pytest.raises(FloatingPointError, match="diverged"):
        runner_.close()
    assert [changed_weights(r) for r in ({"kept": ""}, {"rolled_back": True}, {"reset": True}, {})] == [
        False,
        True,
        True,
        False,
    ]


def test_background_replay_is_deterministic_and_measures_the_serving_copy(tiny, tmp_path):
    from spectrain.adapt.record import read_trace
    from spectrain.adapt.replay import replay

    target, drafter = tiny
    online = build_algorithm(
        "eagle3_tree",
        runner(target),
        copy.deepcopy(drafter),
        tree_depth=3,
        tree_topk=3,
        tree_total=10,
        adapt="bandit",
        adapt_settings=forcing_settings(tmp_path / "trace"),
    )
    for prompt in PROMPTS:
        online.generate(prompt, max_new_tokens=20, sampling=GREEDY)
    manifest, records = read_trace(tmp_path / "trace")
    runs = []
    for background in (True, True, False):
        settings = forcing_settings(min_gap=1, background=background)
        rows = replay(
            copy.deepcopy(records),
            Eagle3Adaptable(copy.deepcopy(drafter)),
            settings,
            CostModel.from_dict(manifest["costs"]),
            gamma=3,
            out=None,
        )
        runs.append([{k: v for k, v in r.items() if k not in ("update_s",)} for r in rows])
    assert runs[0] == runs[1]
    assert {r["arm"] for r in runs[0]} & {"head", "full"}
    # query 1 is measured on the loaded weights in background (query 0's update is published after it), on the
    # updated ones in the foreground: its signal (drafter probabilities at rejections) tells them apart
    assert runs[0][0]["kept"] is True and runs[2][0]["kept"] is True
    assert runs[0][1]["tau"] == runs[0][1]["tau_none"]
    assert runs[0][1]["signal"] != runs[2][1]["signal"]
    assert runs[0][0]["signal"] == runs[2][0]["signal"]


def test_settings_parse_from_command_line_strings():
    base = AdaptSettings(horizon=7)
    parsed = AdaptSettings.with_overrides(
        base, {"validate": "false", "log": "null", "head_lr": "3e-3", "background": "true", "min_gap": "2"}
    )
    assert parsed == AdaptSettings(horizon=7, validate=False, log=None, head_lr=3e-3, background=True, min_gap=2)
    assert AdaptSettings.with_overrides({"horizon": 9, "not_a_setting": 1}, {}) == AdaptSettings(horizon=9)
    with pytest.raises(ValueError, match="bad setting adapt.min_gap: .*'often'"):
        AdaptSettings.with_overrides(base, {"min_gap": "often"})


def test_the_domain_shift_benchmark_serves_each_query_once_in_abba_blocks():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        from adapt_domain_shift import interleaved
    finally:
        sys.path.pop(0)
    assert interleaved(3, 1) == [(0, "none"), (0, "bandit"), (1, "bandit"), (1, "none"), (2, "none"), (2, "bandit")]
    schedule = interleaved(10, 4)
    assert sorted(schedule) == sorted((i, a) for i in range(10) for a in ("none", "bandit"))
    assert [a for i, a in schedule if i < 4] == ["none"] * 4 + ["bandit"] * 4
    assert [a for i, a in schedule if 4 <= i < 8] == ["bandit"] * 4 + ["none"] * 4
    for mode in ("none", "bandit"):  # each mode serves the stream in order
        assert [i for i, a in schedule if a == mode] == list(range(10))
    with pytest.raises(ValueError, match="block must be >= 1"):
        interleaved(3, 0)


def test_the_domain_shift_benchmark_serves_a_specblock_export_with_and_without_the_bandit(tmp_path):
    """``algorithm=specblock_tree``: both modes load the SpecBlock export afresh, the bandit updates its copy, and
    the two modes' outputs are equal (the verifier is untouched)."""
    import sys
    from pathlib import Path

    from tiny_targets import save_tiny_target, set_random_vocab_map
    from transformers import AutoConfig

    from core.assets import target_record
    from core.drafters.specblock import SpecBlockConfig, SpecBlockDrafter, save_native
    from inference.drafters import load_lm

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        from adapt_domain_shift import ShiftConfig, main, run_pair
    finally:
        sys.path.pop(0)
    target_dir = save_tiny_target(tmp_path / "target", layers=4, hidden=32)
    torch.manual_seed(0)
    config = SpecBlockConfig.for_target(
        AutoConfig.from_pretrained(target_dir), draft_vocab_size=500, aux_layer_ids=[0, 1, 2]
    )
    drafter = SpecBlockDrafter(config)
    set_random_vocab_map(drafter, config.vocab_size, 500)
    export = save_native(drafter, tmp_path / "sb", target=target_record(str(target_dir)))
    target = load_lm(str(target_dir), device="cpu", max_seq_len=256)
    cfg = ShiftConfig(
        drafter=str(export),
        target=str(target_dir),
        algorithm="specblock_tree",
        max_new_tokens=10,
        specblock_budget=12,
        specblock_width=3,
    )
    runs = run_pair(cfg, target, [], [("tiny", ids) for ids in PROMPTS], forcing_settings(tmp_path / "log"))
    assert runs["none"]["outputs"] == runs["bandit"]["outputs"]
    assert runs["none"]["updates"] == 0 and runs["bandit"]["updates"] > 0
    with pytest.raises(Exception, match="algorithm=dflash is not one of eagle3_tree, specblock_tree"):
        main(["algorithm=dflash"])
