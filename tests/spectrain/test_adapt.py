"""spectrain.adapt: the cost-aware bandit, its safety rules, lossless serving with adaptation on, and replay."""

from __future__ import annotations

import copy
import csv
import math

import pytest
import torch
from adapt_helpers import PROMPTS, adapter_for, forcing_settings, specblock_drafter, tiny_pair
from tiny_targets import GREEDY, runner, set_random_vocab_map

from inference.algorithms import build_algorithm
from spectrain.adapt.adapter import AdaptSettings, BanditAdapter
from spectrain.adapt.bandit import CostAwareUCB
from spectrain.adapt.cost import CostModel, max_saving, saving
from spectrain.adapt.drafters import Eagle3Adaptable
from spectrain.adapt.signal import ContextBuckets, query_signal

TAU, ITER, HORIZON, MAX_ACCEPT = 2.0, 1.2, 200, 7


def simulate(
    bandit: CostAwareUCB, true_dtau: dict[str, float], costs: dict[str, float], rounds: int, seed: int = 0
) -> list[str]:
    """A stationary environment with known Δτ per arm (Gaussian noise); returns the arms played."""
    generator = torch.Generator().manual_seed(seed)
    played = []
    for _ in range(rounds):
        decision = bandit.decide(0, tau=TAU, iter_ratio=ITER, horizon=HORIZON, max_accept=MAX_ACCEPT, costs=costs)
        played.append(decision.arm)
        if decision.arm != "skip":
            noise = 0.1 * float(torch.randn((), generator=generator))
            bandit.feedback(0, decision.arm, true_dtau[decision.arm] + noise)
    return played


def value(dtau: float, cost: float) -> float:
    return saving(dtau, TAU, ITER, HORIZON, MAX_ACCEPT) - cost


@pytest.mark.parametrize(
    "true_dtau, costs, best",
    [
        ({"head": 0.1, "full": 0.5}, {"head": 2.0, "full": 12.0}, "full"),  # full's bigger gain pays its cost
        ({"head": 0.1, "full": 0.5}, {"head": 2.0, "full": 30.0}, "head"),  # full costs more than it saves
        ({"head": -0.2, "full": 0.0}, {"head": 2.0, "full": 12.0}, "skip"),  # updates do not help
    ],
)
def test_bandit_converges_to_the_best_arm(true_dtau, costs, best):
    values = {arm: value(true_dtau[arm], costs[arm]) for arm in costs}
    expected = max(values, key=values.get) if max(values.values()) > 0 else "skip"
    assert expected == best  # the scenario's known answer
    played = simulate(CostAwareUCB(ucb_c=0.3, prior=1.0), true_dtau, costs, rounds=300)
    assert played[-100:].count(best) >= 90


def test_an_unvisited_context_borrows_the_arms_pooled_statistics():
    bandit = CostAwareUCB(ucb_c=0.0, prior=1.0)
    assert bandit.ucb(1, "head") == 1.0  # never played anywhere: the prior
    bandit.feedback(0, "head", -0.5)
    bandit.feedback(2, "head", -0.1)
    assert bandit.ucb(1, "head") == pytest.approx(-0.3) and bandit.ucb(0, "head") == pytest.approx(-0.5)
    assert bandit.ucb(1, "full") == 1.0


def test_never_picks_an_arm_whose_cost_exceeds_any_possible_gain():
    generator = torch.Generator().manual_seed(1)
    for _ in range(200):
        tau = 1 + 5 * float(torch.rand((), generator=generator))
        iter_ratio = 0.5 + float(torch.rand((), generator=generator))
        bound = max_saving(tau, iter_ratio, HORIZON, MAX_ACCEPT)
        costs = {"head": bound * (1 + float(torch.rand((), generator=generator))), "full": bound * 1.0001}
        bandit = CostAwareUCB(prior=1e6, ucb_c=1e3)  # as optimistic as it gets
        decision = bandit.decide(0, tau=tau, iter_ratio=iter_ratio, horizon=HORIZON, max_accept=MAX_ACCEPT, costs=costs)
        assert decision.arm == "skip"
        assert all(v <= 0 for v in decision.value.values())
    # the same bandit does update once an arm is cheaper than the bound
    cheap = CostAwareUCB(prior=1.0).decide(
        0, tau=2.0, iter_ratio=1.0, horizon=HORIZON, max_accept=MAX_ACCEPT, costs={"head": 1.0, "full": 1e9}
    )
    assert cheap.arm == "head"


def test_signal_and_context_buckets():
    assert query_signal([0.5, 0.25], rounds=2) == pytest.approx((math.log(2) + math.log(4)) / 2)
    assert query_signal([0.0], rounds=0) == pytest.approx(-math.log(1e-6))  # floored, rounds clamped to 1
    buckets = ContextBuckets(bins=4)
    contexts = [buckets.observe(s) for s in [1.0, 2.0, 3.0, 4.0, 5.0, 0.5, 4.5]]
    assert contexts[:2] == [0, 3] and contexts[5] == 0 and contexts[6] == 3


# ------------------------------------------------------------------------------------------------------------
# the adapter on a tiny EAGLE-3 drafter


@pytest.fixture(scope="module")
def tiny():
    return tiny_pair()


def assert_adapts_and_stays_greedy_equal(target, drafter, algorithm_name: str, tmp_path, **options) -> list[dict]:
    """Serve PROMPTS with adapt=bandit under forcing settings: every output equals AR's, some update arm was
    played, the adapted drafter's weights really changed, and the loaded drafter did not. Returns the rows."""
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    ar = build_algorithm("ar", runner(target))
    settings = forcing_settings(tmp_path, **options.pop("settings", {}))
    algorithm = build_algorithm(
        algorithm_name, runner(target), drafter, adapt="bandit", adapt_settings=settings, **options
    )
    for prompt in PROMPTS:
        reference = ar.generate(prompt, max_new_tokens=20, sampling=GREEDY).tokens
        assert algorithm.generate(prompt, max_new_tokens=20, sampling=GREEDY).tokens == reference
    rows = algorithm.adapter.log.rows
    assert len(rows) == len(PROMPTS) and {r["arm"] for r in rows} & set(settings.arm_list())
    adapted = {k.replace(".base_layer.", "."): v for k, v in algorithm.drafter.state_dict().items()}
    assert any(not torch.equal(before[k], adapted[k]) for k in before) or any(  # it did adapt
        ".lora_B" in k and v.abs().sum() > 0 for k, v in adapted.items()
    )
    assert all(torch.equal(before[k], v) for k, v in drafter.state_dict().items())  # on its own copy
    assert algorithm.drafter.embed_tokens.weight is drafter.embed_tokens.weight  # the target's, shared
    return rows


def test_greedy_output_equals_ar_with_adaptation_on(tiny, tmp_path):
    target, drafter = tiny
    drafter = copy.deepcopy(drafter)
    rows = assert_adapts_and_stays_greedy_equal(
        target, drafter, "eagle3_tree", tmp_path, tree_depth=3, tree_topk=3, tree_total=10
    )
    assert torch.equal(drafter.embed_tokens.weight, target.model.embed_tokens.weight)  # never the target's
    with (tmp_path / "decisions.csv").open() as f:
        assert [r["arm"] for r in csv.DictReader(f)] == [r["arm"] for r in rows]


def test_bad_adapt_options_are_one_line_errors(tiny):
    target, drafter = tiny
    with pytest.raises(ValueError, match="adapt=sometimes is unknown"):
        build_algorithm("eagle3_tree", runner(target), drafter, adapt="sometimes")
    with pytest.raises(ValueError, match="adapt.arms must be a non-empty subset"):
        BanditAdapter(Eagle3Adaptable(drafter), CostModel(1.0, {"head": 0.0}), AdaptSettings(arms="head,adam"))
    with pytest.raises(ValueError, match="the lora arm needs LoRA adapters"):
        Eagle3Adaptable(drafter).lora_parameters()


def test_the_engine_finds_the_bandit_through_its_entry_point_and_takes_in_process_kinds(tiny, monkeypatch):
    from inference import round_observers
    from spectrain.adapt.engine import BANDIT

    assert round_observers.observer_kind("bandit") is BANDIT  # pyproject's entry point, not a name in the engine
    target, drafter = tiny
    with pytest.raises(ValueError, match="adapt=mine is unknown; use adapt=none or adapt=bandit"):
        build_algorithm("eagle3_tree", runner(target), drafter, adapt="mine")
    monkeypatch.setattr(round_observers, "_REGISTERED", {})
    round_observers.register_observer("mine", BANDIT)
    assert round_observers.observer_names() == ["bandit", "mine"]
    assert round_observers.observer_kind("mine") is BANDIT


class RecordingObserver:
    """An observer kind that is its own observer: it serves the drafter as given and records each call's query."""

    def __init__(self):
        self.calls: list[tuple[str, object]] = []

    def settings(self, cfg):
        return None

    def attach(self, target, drafter, settings, *, verify_tokens, max_accept):
        return drafter, self

    def begin_query(self, query, prompt_ids, features, last_logits, max_accept):
        self.calls.append(("begin", query))

    def observe_round(self, query, tokens, features, target_logits, accepted, rejected, seconds):
        self.calls.append(("round", query))

    def end_query(self, query, last_token):
        self.calls.append(("end", query))


def test_the_observer_is_told_which_request_each_round_belongs_to(tiny, monkeypatch):
    from inference import round_observers
    from inference.engine.loop import DecodeEngine
    from inference.engine.state import RowRequest

    target, drafter = tiny
    recorder = RecordingObserver()
    monkeypatch.setattr(round_observers, "_REGISTERED", {"recording": recorder})
    algorithm = build_algorithm(
        "eagle3_tree", runner(target), drafter, adapt="recording", tree_depth=3, tree_topk=3, tree_total=10
    )
    queue = [RowRequest(key, prompt, 9, GREEDY, None) for key, prompt in zip("ab", PROMPTS)]
    DecodeEngine(algorithm.target, algorithm.strategy()).run(
        lambda: queue.pop(0) if queue else None, lambda event: None
    )
    for key in "ab":
        calls = [call for call, query in recorder.calls if query == key]
        assert calls[0] == "begin" and calls[-1] == "end" and set(calls[1:-1]) == {"round"}
    assert [q for _, q in recorder.calls] == sorted(q for _, q in recorder.calls)  # one row: a, then b


def test_the_bandit_keeps_interleaved_queries_apart(tiny):
    """Rounds of two queries that interleave (as rows side by side would) go to each query's own record."""
    target, drafter = tiny
    adapter, _ = adapter_for(drafter, min_gap=100)
    width, vocab = 3 * target.config.hidden_size, target.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    features = {q: torch.randn(5, width, generator=generator) for q in "xy"}
    adapter.begin_query("x", [1, 2, 3, 4, 5], features["x"], torch.randn(vocab, generator=generator), max_accept=4)
    adapter.begin_query("y", [6, 7, 8, 9, 10], features["y"], torch.randn(vocab, generator=generator), max_accept=4)
    for q, n in (("x", 3), ("y", 1), ("x", 2)):
        adapter.observe_round(
            q,
            list(range(n)),
            torch.randn(n, width, generator=generator),
            torch.randn(n, vocab, generator=generator),
            n - 1,
            None,
            0.5,
        )
    x, y = adapter.recorders["x"][0], adapter.recorders["y"][0]
    assert x.accepted == [2, 1] and x.tokens == [1, 2, 3, 4, 5, 0, 1, 2, 0, 1]
    assert y.accepted == [0] and y.tokens == [6, 7, 8, 9, 10, 0] and len(y.features) == 2
    assert x.decode_s == 1.0 and y.decode_s == 0.5  # each query's rounds' seconds, as the engine charged them
    adapter.end_query("x", 7)
    assert set(adapter.recorders) == {"y"}
    adapter.end_query("y", 7)
    assert adapter.recorders == {}


@torch.no_grad()
def loss_of(adaptable, record, arm: str) -> float:
    """The training loss of ``arm`` on ``record`` as the drafter stands, computed afresh."""
    return float(adaptable.loss_closure(record, arm)())


@pytest.mark.parametrize(
    "taus, rolled_back_at",
    [
        ([2.0, 1.0, 1.0], 2),  # two consecutive queries below the pre-update EMA -> restore the snapshot
        ([2.0, 1.0, 3.0], None),  # one bad query is not enough
    ],
)
def test_rollback_after_consecutive_drops(tiny, taus, rolled_back_at):
    target, drafter = tiny
    drafter = copy.deepcopy(drafter)
    adapter, adaptable = adapter_for(drafter)
    record = adaptable.synthetic_record(24, prompt_len=6)
    record.max_accept = 7
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    rows = [adapter.process(record, tau=tau, signal=1.0, iter_ratio=1.0) for tau in taus]
    assert [r["arm"] for r in rows] == ["head", "skip", "skip"]
    assert [r["rolled_back"] for r in rows] == [i == rolled_back_at for i in range(len(taus))]
    same = all(torch.equal(before[k], v) for k, v in drafter.state_dict().items())
    assert same == (rolled_back_at is not None)  # restored exactly, or the update stays


@pytest.mark.parametrize("rollback_to", ["last", "origin"])
def test_rollback_restores_the_last_snapshot_or_the_origin(tiny, rollback_to):
    target, drafter = tiny
    drafter = copy.deepcopy(drafter)
    adapter, adaptable = adapter_for(drafter, ucb_c=0.0, rollback_to=rollback_to)  # min_gap=3 -> 2 below
    adapter.settings.min_gap = 2
    record = adaptable.synthetic_record(24, prompt_len=6)
    record.max_accept = 7
    states = [{k: v.clone() for k, v in drafter.state_dict().items()}]
    rows = []
    for tau in [2.0, 2.5, 2.5, 1.0, 1.0]:
        rows.append(adapter.process(record, tau=tau, signal=1.0, iter_ratio=1.0))
        states.append({k: v.clone() for k, v in drafter.state_dict().items()})
    assert [r["arm"] for r in rows] == ["head", "skip", "head", "skip", "skip"]
    assert [r["rolled_back"] for r in rows] == [False] * 4 + [True]
    expected = states[0] if rollback_to == "origin" else states[1]  # before the 1st / the 2nd update
    assert all(torch.equal(expected[k], v) for k, v in states[-1].items())
    assert not all(torch.equal(states[0][k], v) for k, v in states[1].items())


def test_at_most_one_update_per_min_gap_queries(tiny):
    target, drafter = tiny
    adapter, adaptable = adapter_for(copy.deepcopy(drafter))  # min_gap=3
    record = adaptable.synthetic_record(24, prompt_len=6)
    record.max_accept = 7
    rows = [adapter.process(record, tau=2.0, signal=1.0, iter_ratio=1.0) for _ in range(5)]
    assert [r["arm"] for r in rows] == ["head", "skip", "skip", "head", "skip"]
    assert [r["forced"] for r in rows] == ["", "rate_limit", "rate_limit", "", "rate_limit"]


def test_costly_arms_are_never_played_and_leave_the_drafter_alone(tiny):
    target, drafter = tiny
    drafter = copy.deepcopy(drafter)
    adapter, adaptable = adapter_for(drafter, costs_per_row=10.0)  # every update costs ~10^4 target forwards
    record = adaptable.synthetic_record(24, prompt_len=6)
    record.max_accept = 7
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    rows = [adapter.process(record, tau=1.5, signal=float(i), iter_ratio=1.0) for i in range(6)]
    assert [r["arm"] for r in rows] == ["skip"] * 6 and all(r["forced"] == "" for r in rows)
    assert all(torch.equal(before[k], v) for k, v in drafter.state_dict().items())


@pytest.mark.parametrize("held_out_seed, kept", [(1, True), (2, False)])
def test_validation_keeps_an_update_only_if_the_held_out_loss_drops(tiny, held_out_seed, kept):
    """The first query cannot update (nothing held out); the second trains on itself and is judged on the first:
    the same record (seed 1) must improve, an unrelated one (seed 2) under a huge step must not, and then the
    drafter is exactly as before."""
    target, drafter = tiny
    drafter = copy.deepcopy(drafter)
    adapter, adaptable = adapter_for(drafter, validate=True, min_gap=1, head_lr=1e-2 if kept else 50.0)
    first, second = (adaptable.synthetic_record(24, prompt_len=6, seed=s) for s in (held_out_seed, 1))
    first.max_accept = second.max_accept = 7
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    rows = [adapter.process(r, tau=1.5, signal=1.0, iter_ratio=1.0) for r in (first, second)]
    assert [r["arm"] for r in rows] == ["skip", "head"] and rows[0]["forced"] == "no_held_out"
    assert rows[1]["kept"] is kept
    assert (rows[1]["val_loss_after"] < rows[1]["val_loss_before"]) is kept
    # one scorer served before and after the head update: its scores are those of the drafter recomputed afresh
    standing = loss_of(adaptable, first, "full")
    assert standing == pytest.approx(rows[1]["val_loss_after" if kept else "val_loss_before"], rel=1e-5)
    unchanged = all(torch.equal(before[k], v) for k, v in drafter.state_dict().items())
    assert unchanged is not kept
    assert (adapter.watch is not None) is kept  # an undone update has nothing left to watch


def test_undone_updates_back_off_the_update_rate(tiny):
    """Every update fails validation (a huge step on an unrelated record), so the gap between attempts doubles:
    queries 1 (the first with a held-out query), then 5 (gap 2 doubled), then not before 13 (gap 8), and the
    drafter ends exactly as it started."""
    target, drafter = tiny
    drafter = copy.deepcopy(drafter)
    adapter, adaptable = adapter_for(drafter, validate=True, min_gap=2, head_lr=50.0, backoff=4)
    adapter.costs.refine = 0.0  # keep updates cheap in the cost model: only the backoff may space them out
    records = [adaptable.synthetic_record(24, prompt_len=6, seed=s) for s in range(9)]
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    rows = []
    for record in records:
        record.max_accept = 7
        rows.append(adapter.process(record, tau=1.5, signal=1.0, iter_ratio=1.0))
    assert [i for i, r in enumerate(rows) if r["arm"] == "head"] == [1, 5]
    assert [r["kept"] for r in rows if r["arm"] == "head"] == [False] * 2
    assert [r["forced"] for r in rows[6:]] == ["rate_limit"] * 3
    assert all(torch.equal(before[k], v) for k, v in drafter.state_dict().items())


def test_update_is_bounded_and_uses_the_training_loss(tiny):
    """head touches only norm + lm_head; the loss is the TTT loss of spectrain.kinds.eagle3.module (it decreases)."""
    target, drafter = tiny
    drafter = copy.deepcopy(drafter)
    adapter, adaptable = adapter_for(drafter)
    record = adaptable.synthetic_record(24, prompt_len=6)
    # the head arm's loss runs lm_head on supervised rows only: the same value (validation scores this way)
    assert loss_of(adaptable, record, "head") == pytest.approx(loss_of(adaptable, record, "full"), rel=1e-5)
    head = {id(p) for p in adaptable.head_parameters()}
    before = {name: p.detach().clone() for name, p in drafter.named_parameters()}
    result = adapter.updater.update(record, "head")
    assert result.steps == adapter.settings.head_steps and result.loss_after < result.loss_before
    for name, p in drafter.named_parameters():
        assert torch.equal(before[name], p) != (id(p) in head), name
    assert all(p.requires_grad == (name != "embed_tokens.weight") for name, p in drafter.named_parameters())


def test_lora_arm_adds_adapters_that_change_nothing_until_trained_and_trains_only_them(tiny):
    """peft LoRA on the decoder linears: zero-initialised (same logits), only adapters move, same TTT loss."""
    from spectrain.adapt.engine import adaptable_with_settings

    target, drafter = tiny
    drafter = copy.deepcopy(drafter)
    plain = Eagle3Adaptable(copy.deepcopy(drafter))
    record = plain.synthetic_record(24, prompt_len=6)
    with torch.no_grad():
        loss_plain = float(plain.loss_closure(record, "full")())
    adaptable = adaptable_with_settings(drafter, AdaptSettings(arms="head,lora", lora_rank=4))
    lora = {id(p) for p in adaptable.lora_parameters()}
    assert len(lora) == 2 * 7  # A and B on q, k, v, o, gate, up, down
    with torch.no_grad():
        assert float(adaptable.loss_closure(record, "lora")()) == pytest.approx(loss_plain, rel=1e-6)
    before = {name: p.detach().clone() for name, p in drafter.named_parameters()}
    updater = BanditAdapter.updater_for(adaptable, AdaptSettings(lora_lr=1e-2))
    result = updater.update(record, "lora")
    assert result.steps == 2 and result.loss_after < result.loss_before
    for name, p in drafter.named_parameters():  # step 1 moves B off zero, step 2 then moves A too
        assert (not torch.equal(before[name], p)) == (id(p) in lora), name
    assert all(p.requires_grad == (name != "embed_tokens.weight") for name, p in drafter.named_parameters())
    snapshot_ids = {id(p) for p, _ in updater.snapshot()}
    assert lora <= snapshot_ids  # rollback restores the adapters too


def test_eagle3_tree_stays_greedy_equal_with_the_lora_arm(tiny, tmp_path):
    target, drafter = tiny
    rows = assert_adapts_and_stays_greedy_equal(
        target, drafter, "eagle3_tree", tmp_path, tree_depth=3, tree_topk=3, tree_total=10, settings={"arms": "lora"}
    )
    assert {r["arm"] for r in rows} <= {"skip", "lora"}
    assert all(r["ucb_lora"] != "" and r["cost_lora"] != "" for r in rows)  # the log keeps the lora columns


def test_buffered_update_trains_on_the_mean_loss_of_recent_queries(tiny):
    target, drafter = tiny
    adapter, adaptable = adapter_for(copy.deepcopy(drafter), buffer=2)
    records = [adaptable.synthetic_record(24, prompt_len=6, seed=s) for s in (1, 2)]
    with torch.no_grad():
        separate = [float(adaptable.loss_closure(r, "full")()) for r in records]
    result = adapter.updater.update(records, "full")
    assert result.loss_before == pytest.approx(sum(separate) / 2, rel=1e-6)
    for record in records:
        record.max_accept = 7
    adapter.costs.refine = 0.0  # keep the cost per row fixed (an update would refine it with its wall time)
    rows = [adapter.process(r, tau=2.0, signal=1.0, iter_ratio=1.0) for r in records]
    assert [len(adapter.recent), rows[1]["cost_head"]] == [2, pytest.approx(2 * rows[0]["cost_head"])]


def test_replay_is_deterministic(tiny, tmp_path):
    """Record traces online (adapt_log), then replay them twice from the same drafter: identical decisions."""
    from spectrain.adapt.record import read_trace
    from spectrain.adapt.replay import replay

    target, drafter = tiny
    start = copy.deepcopy(drafter)
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
    assert len(records) == len(PROMPTS) and manifest["max_accept"] == 4
    runs = []
    for i in range(2):
        drafter_copy = copy.deepcopy(start)
        settings = forcing_settings(min_gap=2)
        rows = replay(
            copy.deepcopy(records),
            Eagle3Adaptable(drafter_copy),
            settings,
            CostModel.from_dict(manifest["costs"]),
            gamma=3,
            out=tmp_path / f"replay{i}",
        )
        runs.append(
            (
                [{k: v for k, v in r.items() if k != "update_s"} for r in rows],
                {k: v.clone() for k, v in drafter_copy.state_dict().items()},
            )
        )
    assert runs[0][0] == runs[1][0]
    assert {r["arm"] for r in runs[0][0]} & {"head", "full"}  # the replay really updated
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
    assert (tmp_path / "replay0" / "decisions.csv").is_file()


def test_specblock_plugs_in_with_its_own_losses(tiny):
    """A SpecBlock drafter gets its adapter class from adaptable_for; updates use spectrain.kinds.specblock.losses."""
    from spectrain.adapt.drafters import SpecBlockAdaptable, adaptable_for
    from spectrain.adapt.updater import ArmUpdate, Updater

    target, _ = tiny
    drafter = specblock_drafter(target)
    adaptable = adaptable_for(drafter, max_rows=64)
    assert isinstance(adaptable, SpecBlockAdaptable)
    record = adaptable.synthetic_record(24, prompt_len=6)
    updater = Updater(adaptable, {"head": ArmUpdate(3, 1e-3), "full": ArmUpdate(3, 1e-3)})
    head = {id(p) for p in drafter.head_parameters()}
    before = {name: p.detach().clone() for name, p in drafter.named_parameters()}
    # the closure is the training objective itself (docs/algorithms/specblock.md §5: the total over the unrolled blocks)
    from spectrain.kinds.specblock.losses import total_loss, unroll_blocks

    with torch.no_grad():
        direct = total_loss(unroll_blocks(drafter, *adaptable._row_frame(record), [2]))
        assert float(adaptable.loss_closure(record, "full")()) == pytest.approx(float(direct))
    result = updater.update(record, "head")
    assert math.isfinite(result.loss_after)
    for name, p in drafter.named_parameters():
        assert torch.equal(before[name], p) != (id(p) in head), name
    updater.update(record, "full")
    assert not torch.equal(before["fc.weight"], drafter.fc.weight)
    assert torch.equal(before["embed_tokens.weight"], drafter.embed_tokens.weight)
    tau, rejection_q, starts = adaptable.simulate(record, gamma=3)
    assert 1.0 <= tau <= 4.0 and starts > 0 and len(rejection_q) <= starts
    assert all(0.0 <= q <= 1.0 for q in rejection_q)


def test_replay_cli_is_deterministic_and_writes_csv_and_png(tmp_path):
    """python -m spectrain.adapt.replay traces=DIR drafter=PATH on traces recorded by the engine hook."""
    from tiny_targets import save_tiny_target

    from core.assets import target_record
    from core.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from core.drafters.eagle3.layouts import Eagle3Checkpoint
    from inference.drafters import load_lm
    from core.drafters.eagle3.kind import load_eagle3
    from spectrain.adapt import replay as replay_cli
    from spectrain.kinds.eagle3.export import write_export

    target_dir = save_tiny_target(tmp_path / "target", layers=4)
    target = load_lm(str(target_dir), device="cpu", max_seq_len=128)
    config = Eagle3Config.for_target(target.model.config, draft_vocab_size=256, aux_layer_ids=[0, 1, 2])
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config, embed_weight=target.runner.embed_tokens.weight)
    vocab = config.vocab_size
    set_random_vocab_map(drafter, vocab, 256)
    export = write_export(Eagle3Checkpoint.from_drafter(drafter, target_record(str(target_dir))), tmp_path / "e3")

    online = build_algorithm(
        "eagle3_tree",
        target.runner,
        load_eagle3(str(export), target),
        tree_depth=3,
        tree_topk=3,
        tree_total=10,
        adapt="bandit",
        adapt_settings=forcing_settings(tmp_path / "trace"),
    )
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        prompt = torch.randint(1000, (8,), generator=generator).tolist()
        online.generate(prompt, max_new_tokens=16, sampling=GREEDY)
    tables = []
    for i in range(2):
        out = tmp_path / f"replay{i}"
        assert replay_cli.main([f"traces={tmp_path / 'trace'}", f"drafter={export}", f"out={out}", "min_gap=1"]) == 0
        with (out / "decisions.csv").open() as f:
            tables.append([{k: v for k, v in row.items() if k != "update_s"} for row in csv.DictReader(f)])
        assert (out / "tau.png").stat().st_size > 0
    assert tables[0] == tables[1] and len(tables[0]) == 3
    assert {row["arm"] for row in tables[0]} & {"head", "full"}
    assert replay_cli.main([f"traces={tmp_path / 'nothing'}", f"drafter={export}"]) == 2  # one-line error


def test_specblock_tree_greedy_output_equals_ar_with_adaptation_on(tiny, tmp_path):
    """adapt=bandit on specblock_tree: the drafter changes between queries, the output never does."""

    target, _ = tiny
    drafter = specblock_drafter(target)
    assert_adapts_and_stays_greedy_equal(target, drafter, "specblock_tree", tmp_path, width=3, budget=12)


@pytest.mark.parametrize("taus, kept", [((1.5, 1.75), True), ((1.5, 1.5), False), ((1.5, 1.25), False)])
def test_validation_on_tau_keeps_an_update_only_if_the_held_out_accept_length_rises(tiny, taus, kept):
    """validate_on=tau judges an update by τ_sim of the held-out query (chains of tree depth = max_accept − 1
    drafts), before and after, instead of its loss; a tie is not an improvement."""
    target, drafter = tiny
    drafter = copy.deepcopy(drafter)
    adapter, adaptable = adapter_for(drafter, validate=True, validate_on="tau", min_gap=1)
    first, second = (adaptable.synthetic_record(24, prompt_len=6, seed=s) for s in (1, 2))
    first.max_accept = second.max_accept = 5
    scripted, calls = iter(taus), []

    def simulate(record, gamma):
        calls.append((record, gamma))
        return next(scripted), [], 1

    adaptable.simulate = simulate
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    rows = [adapter.process(r, tau=1.5, signal=1.0, iter_ratio=1.0) for r in (first, second)]
    assert [r["arm"] for r in rows] == ["skip", "head"] and rows[1]["kept"] is kept
    assert calls == [(first, 4), (first, 4)]  # the held-out query, before and after the update
    assert (rows[1]["val_tau_before"], rows[1]["val_tau_after"]) == taus
    assert (adapter.log.rows[1]["val_tau_before"], adapter.log.rows[1]["val_tau_after"]) == taus  # logged too
    assert all(torch.equal(before[k], v) for k, v in drafter.state_dict().items()) is not kept
    with pytest.raises(ValueError, match="adapt.validate_on must be loss or tau"):
        adapter_for(drafter, validate_on="accuracy")


@pytest.mark.parametrize(
    "arm, lr, check_seed, reset",
    [("head", 50.0, 2, True), ("head", 1e-2, 1, False), ("full", 1.0, 2, True), ("full", 50.0, 2, True)],
)
def test_origin_check_goes_back_to_the_original_when_it_scores_better(tiny, arm, lr, check_seed, reset):
    """Query 0 updates on record 1 and the τ watch lets it stay; at query 1 the origin check scores that query's
    record under the adapted and the original weights (the head arm: one trunk pass serves both). A huge step has wrecked the drafter for an unrelated record
    (seed 2): it goes back to the original, exactly. A small step on the same record helps: the adapted weights
    stay, and so does a drafter that never adapted (no check at all)."""
    target, drafter = tiny
    drafter = copy.deepcopy(drafter)
    adapter, adaptable = adapter_for(
        drafter, arms=arm, min_gap=10, watch=1, patience=1, origin_check=1, head_lr=lr, full_lr=lr
    )
    first, checked = (adaptable.synthetic_record(24, prompt_len=6, seed=s) for s in (1, check_seed))
    first.max_accept = checked.max_accept = 7
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    rows = [adapter.process(r, tau=t, signal=1.0, iter_ratio=1.0) for r, t in ((first, 1.5), (checked, 2.0))]
    assert [r["arm"] for r in rows] == [arm, "skip"] and not rows[1]["rolled_back"]
    assert rows[1]["reset"] is reset and not rows[0]["reset"]
    assert (not rows[1]["check_loss_adapted"] <= rows[1]["check_loss_origin"]) is reset  # lr 50 on full: NaN
    unchanged = all(torch.equal(before[k], v) for k, v in drafter.state_dict().items())
    assert unchanged is reset and adapter.adapted is not reset
    standing = loss_of(adaptable, checked, "full")  # the drafter it kept, scored afresh
    assert standing == pytest.approx(rows[1]["check_loss_origin" if reset else "check_loss_adapted"], rel=1e-5)
    later = adapter.process(checked, tau=2.0, signal=1.0, iter_ratio=1.0)  # checked again only while adapted
    assert ("check_s" in later) is not reset
    with pytest.raises(ValueError, match="adapt.origin_check must be >= 0"):
        adapter_for(drafter, origin_check=-1)


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0])
def test_teacher_temperature_sharpens_the_update_target_without_moving_its_argmax(tiny, temperature):
    """adapt_teacher_temperature: 1 is the training loss as is; 0 is cross-entropy on the target's greedy token
    (what a greedy verifier accepts); the simulated accept length (argmax-based) does not depend on it."""
    from spectrain.adapt.drafters import sharpened

    target, drafter = tiny
    plain = Eagle3Adaptable(drafter, ttt_steps=1)
    sharp = Eagle3Adaptable(drafter, ttt_steps=1, teacher_temperature=temperature)
    record = plain.synthetic_record(24, prompt_len=6, seed=3)
    logits = record.teacher
    assert torch.equal(sharpened(logits, temperature).argmax(-1), logits.argmax(-1))
    batch = sharp.batch(record)
    with torch.no_grad():
        students = drafter(batch["input_ids"], batch["aux_hidden"], steps=1).logits[0]
    # step 0's row i predicts token i+2 from the target's distribution at position i+1 (teacher rows start at
    # the prompt's last position): rows prompt-2 .. rows-2 carry the loss
    rows = torch.arange(record.prompt_len - 2, record.num_rows - 1)
    if temperature == 0.0:
        expected = torch.nn.functional.cross_entropy(students[0, rows], logits.argmax(-1))
        assert loss_of(sharp, record, "full") == pytest.approx(float(expected), rel=1e-5)
    if temperature == 1.0:
        assert loss_of(sharp, record, "full") == loss_of(plain, record, "full")
    assert sharp.simulate(record, 2) == plain.simulate(record, 2)
    with pytest.raises(ValueError, match="adapt.teacher_temperature must be >= 0"):
        Eagle3Adaptable(drafter, teacher_temperature=-1.0)


def test_the_cost_cache_defaults_to_the_projects_cache_folder(tmp_path, monkeypatch):
    """adapt.cost_cache=auto (the default) follows $SPECTRAIN_CACHE like every other cache; a path is that file."""
    from spectrain.adapt.adapter import AdaptSettings
    from spectrain.adapt.cost import cost_cache_path

    monkeypatch.setenv("SPECTRAIN_CACHE", str(tmp_path / "cache"))
    assert cost_cache_path(AdaptSettings().cost_cache) == tmp_path / "cache" / "adapt_costs.json"
    assert cost_cache_path(str(tmp_path / "costs.json")) == tmp_path / "costs.json"
    assert cost_cache_path(None) is None
