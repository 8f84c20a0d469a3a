"""SpecBranch (docs/algorithms/specbranch.md §2–10): greedy exactness for k in {1,2,3} and each forced H-RAD class, identical tokens from
every executor, KV bookkeeping, cached branch-point q, H-RAD feature convention; the measurement policies
(class0/class2, the oracles) and the serving-position hook (on_branch). The sampling law: test_sampling_laws.py."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from pearl_helpers import PROMPT, ar_tokens, assert_executor_matches_sequential, tiny_pair
from tiny_targets import GREEDY, runner, tiny_llama

from core.overrides import OverrideError
from inference.algorithms import algorithm_class, build_algorithm
from inference.algorithms.specbranch import continuation_to_keep, true_class
from inference.draft_side import draft_side_from_runner
from inference.engine_args import engine_context
from inference.runner import ModelRunner
from inference.sampling import SamplingParams


class ForcedClass:
    """A stub H-RAD that always answers ``cls`` (§10), recording the features it was given."""

    def __init__(self, cls: int, capture_layers: list[int] = ()):
        self.cls, self.capture_layers, self.calls = cls, list(capture_layers), []

    def predict(self, hidden_lastk: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        self.calls.append((hidden_lastk, token_emb))
        return torch.nn.functional.one_hot(torch.tensor([self.cls]), 3).float()


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


def specbranch(target, draft, rounds: list | None = None, **kwargs):
    return build_algorithm(
        "specbranch", runner(target), runner(draft), on_round=None if rounds is None else rounds.append, **kwargs
    )


@pytest.mark.parametrize("hrad", [None, 0, 1, 2])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_equals_ar(pair, k, hrad):
    """k = max(1, ⌊kmax(1 − q_b)⌋) reaches kmax only at q_b = 0, so k branches need kmax = k + 1 (k > 1)."""
    kmax = 1 if k == 1 else k + 1
    target, draft = pair
    gamma, rounds = 4, []
    algo = specbranch(target, draft, rounds, gamma=gamma, kmax=kmax, hrad=None if hrad is None else ForcedClass(hrad))
    result = algo.generate(PROMPT, max_new_tokens=40, sampling=GREEDY)
    assert result.tokens == ar_tokens(target, 40)
    assert max(r.branches for r in rounds) == k  # the flat draft (q_b < 1/4) forks as wide as allowed
    survived = [r for r in rounds if r.survivor is not None]
    assert survived and all(r.hrad_class == (1 if hrad is None else hrad) for r in survived)
    if hrad in (0, 2):
        assert {r.keep for r in survived} == {0 if hrad == 0 else gamma - 1}
    if k > 1:
        assert any(r.survivor > 0 for r in survived)  # a branch other than the draft's favourite was kept
    stats = result.stats
    assert stats.target_forwards == stats.rounds == len(rounds)
    assert stats.drafted_tokens >= stats.accepted_draft_tokens >= 0 and 0 <= stats.rollback_rate <= 1


@pytest.mark.parametrize("hrad", [None, 0, 2])
def test_kv_bookkeeping(pair, hrad):
    """After every round the target holds |S|-1 tokens and the draft |S|+|U| when the branch-point q is cached
    (a survivor cut short), |S|+|U|-1 otherwise; the cached q is really reused (no draft forward for it)."""
    target, draft = pair
    gamma, rounds = 4, []
    algo = specbranch(target, draft, rounds, gamma=gamma, kmax=3, hrad=None if hrad is None else ForcedClass(hrad))

    def check(r):
        rounds.append(r)
        assert r.target_len == r.committed - 1
        length, cached = algo.executor.call("select", list(r.context))  # what the next draft job starts from
        assert cached == (r.survivor is not None and r.keep < gamma - 1)
        assert length == len(r.context) - (0 if cached else 1) and len(r.context) == r.committed + r.pending

    algo.on_round = check
    result = algo.generate(PROMPT, max_new_tokens=40, sampling=GREEDY)
    assert result.tokens == ar_tokens(target, 40)
    reused = sum(r.survivor is not None and r.keep < gamma - 1 for r in rounds[:-1])
    # each round: (1 forward unless q is cached) + γ-1 batched branch steps
    assert result.stats.draft_forwards == len(rounds) * gamma - reused
    assert hrad == 2 or reused > 0


@pytest.mark.parametrize("hrad", [0, 2])
def test_rollback_rates_count_what_was_bet_on(pair, hrad):
    """rollback_rate_speculated counts only the branch-point token and the kept continuation (verified next
    round); rollback_rate counts every drafted token, siblings and the H-RAD cut included."""
    target, draft = pair
    gamma, rounds = 4, []
    algo = specbranch(target, draft, rounds, gamma=gamma, kmax=3, hrad=ForcedClass(hrad))
    result = algo.generate(PROMPT, max_new_tokens=40, sampling=GREEDY)
    metrics = algo.extra_metrics()
    accepted = sum(r.pending_accepted + (r.survivor is not None) for r in rounds)
    speculated = len(rounds) + sum(r.pending for r in rounds[:-1])  # each round verifies U + the branch point
    assert accepted == result.stats.accepted_draft_tokens
    assert metrics["rollback_rate_speculated"] == round(1 - accepted / speculated, 4)
    assert metrics["sibling_branch_tokens"] == sum((r.branches - 1) * gamma for r in rounds)
    assert metrics["rollback_rate_speculated"] < metrics["rollback_rate_without_siblings"] <= result.stats.rollback_rate
    assert algo.extra_metrics()["rollback_rate_speculated"] == 0.0  # counters restart per report


def test_cached_branch_point_q_equals_a_fresh_forward(pair):
    _, draft = pair
    side = draft_side_from_runner(runner(draft), 3)
    side.start(0)
    branches = side.branches(PROMPT, 3, 4)
    assert len(branches.tokens) == 2 and branches.forwards == 4
    for row, keep in ((1, 0), (0, 2)):
        context = PROMPT + branches.tokens[row][: 1 + keep]
        length, cached = side.select(context)
        assert cached and length == len(context) and side.lengths() == [len(context)]
        fresh = runner(draft).forward(torch.tensor([context])).logits[0, -1]
        torch.testing.assert_close(side.logits[0][length], fresh, atol=1e-5, rtol=1e-5)
        side.branches(PROMPT, 3, 4)  # fork again for the next check


def test_continuation_cut_per_class():
    confidence = [0.9, 0.1, 0.8, 0.2, 0.9]  # branch token, then 4 continuation tokens
    assert continuation_to_keep(0, confidence, 0.3) == 0
    assert continuation_to_keep(1, confidence, 0.3) == 2  # 1st continuation kept even though low; stops at c_3
    assert continuation_to_keep(1, confidence, 0.05) == 4
    assert continuation_to_keep(2, confidence, 0.3) == 4
    # cut_from=1: the rule also checks the first continuation token, so it may keep none
    assert continuation_to_keep(1, confidence, 0.3, cut_from=1) == 0
    assert continuation_to_keep(1, [0.9, 0.5, 0.8, 0.2, 0.9], 0.3, cut_from=1) == 2
    assert continuation_to_keep(0, confidence, 0.3, cut_from=1) == 0


def test_hrad_features_follow_the_last_k_convention():
    """The predictor sees [1, K, d] = HF hidden_states[-K:] at the position before the survivor token, and the
    target's input embedding of that token [1, d] (a real HRADPredictor checks the shapes too)."""
    from core.drafters.hrad import HRAD, HRADConfig, HRADPredictor, capture_layers

    target = tiny_llama(0, layers=4, temperature_scale=8.0)
    draft = tiny_llama(0, layers=4, temperature_scale=8.0)
    real = HRADPredictor(
        HRAD(HRADConfig(hidden_size=32, last_k=4, gamma=4, boundaries=[1, 3])),
        {"layers": {"ids": capture_layers(4, 4)}},
    )

    class Recording(ForcedClass):
        def predict(self, hidden_lastk, token_emb):
            super().predict(hidden_lastk, token_emb)
            return real.predict(hidden_lastk, token_emb)

    hrad, rounds = Recording(0, real.capture_layers), []
    algo = specbranch(target, draft, rounds, gamma=4, kmax=2, hrad=hrad)
    assert algo.generate(PROMPT, max_new_tokens=12, sampling=GREEDY).tokens == ar_tokens(target, 12)
    survived = [r for r in rounds if r.survivor is not None]
    assert len(hrad.calls) == len(survived) > 0
    for (lastk, emb), r in zip(hrad.calls, survived):
        sequence = list(r.context[: r.committed])
        assert lastk.shape == (1, 4, 32) and emb.shape == (1, 32)
        with torch.no_grad():
            states = target(torch.tensor([sequence[:-1]]), output_hidden_states=True).hidden_states
        expected = torch.stack([h[0, -1] for h in states[-4:]])
        torch.testing.assert_close(lastk[0], expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(emb[0], target.model.embed_tokens.weight[sequence[-1]])


@pytest.mark.parametrize("name", ["cuda_streams", pytest.param("multiprocess", marks=pytest.mark.slow)])
def test_every_executor_gives_the_sequential_tokens(pair, name):
    target, draft = pair
    assert_executor_matches_sequential(
        target, name, lambda executor, **kw: specbranch(target, draft, gamma=4, kmax=3, executor=executor, **kw), kmax=3
    )


def test_bad_options_are_one_line_errors(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="gamma and kmax must be >= 1"):
        specbranch(target, draft, kmax=0)
    with pytest.raises(ValueError, match=r"specbranch\.cut_from must be 1 .* or 2"):
        specbranch(target, draft, cut_from=3)
    with pytest.raises(ValueError, match="is not an H-RAD export"):
        specbranch(target, draft, hrad="/nonexistent/hrad")
    side = draft_side_from_runner(runner(draft), 1)
    with pytest.raises(ValueError, match="need a draft runner with max_batch_size >= 3"):
        side._fork(3)


@pytest.mark.gpu
def test_cuda_streams_on_gpu_gives_the_sequential_tokens():
    """On CUDA the draft job runs on its own stream in a worker thread; tokens must not change."""
    target, draft = (m.to("cuda", torch.float32) for m in tiny_pair())

    def run(executor: str) -> list[int]:
        algo = build_algorithm(
            "specbranch",
            ModelRunner.from_hf_model(target, max_seq_len=192, dtype=torch.float32),
            ModelRunner.from_hf_model(draft, max_seq_len=192, dtype=torch.float32),
            gamma=4,
            kmax=4,
            executor=executor,
        )
        try:
            return algo.generate(PROMPT, max_new_tokens=32, sampling=GREEDY).tokens
        finally:
            algo.close()

    assert run("cuda_streams") == run("sequential")


@pytest.mark.parametrize("name", ["pearl", "specbranch"])
def test_options_come_from_both_clis(name):
    from inference import evaluate as evaluate_cli
    from inference import generate as generate_cli

    args = [f"{name}.gamma=3", "drafter=/models/draft", f"{name}.executor=multiprocess"]
    args += ["specbranch.hrad=/exports/hrad", "specbranch.kmax=4"] if name == "specbranch" else []
    eval_cfg = evaluate_cli.parse_args([f"algorithms=[{name}]"] + args)
    gen_cfg, _ = generate_cli.parse_engine_cli(["prompt=hi"] + args, generate_cli.GenerateConfig, generate_cli.USAGE)
    assert eval_cfg[name] == gen_cfg[name]
    options = OmegaConf.to_object(eval_cfg[name])
    assert (options.gamma, options.executor) == (3, "multiprocess")
    assert engine_context(eval_cfg, None, algorithm_class(name).context) == {"draft_path": "/models/draft"}
    assert name == "pearl" or (options.kmax, options.hrad) == (4, "/exports/hrad")


# ------------------------------------------------------------------------------------- measurement policies


def realised_from_ar(reference: list[int], prompt_len: int, position: int, tokens: tuple[int, ...]) -> int:
    """Continuation tokens of a survivor (branch token at sequence ``position``) equal to AR's greedy tokens."""
    start = position - prompt_len + 1  # index in AR's output of the first continuation token
    n = 0
    for j, token in enumerate(tokens[1:]):
        if start + j >= len(reference) or reference[start + j] != token:
            break
        n += 1
    return n


@pytest.mark.parametrize("policy", ["class0", "class2", "oracle", "oracle_keep"])
def test_measurement_policies_are_lossless_and_the_oracles_know_the_true_class(pair, policy):
    target, draft = pair
    gamma, rounds, points = 4, [], []
    algo = specbranch(target, draft, rounds, gamma=gamma, kmax=3, hrad=policy, on_branch=points.append)
    result = algo.generate(PROMPT, max_new_tokens=40, sampling=GREEDY)
    reference = ar_tokens(target, 40 + 3 * gamma)  # the last round may commit past the budget
    assert result.tokens == reference[:40]
    survived = [r for r in rounds if r.survivor is not None]
    assert len(points) == len(survived) > 0
    realised = [realised_from_ar(reference, len(PROMPT), p.position, p.tokens) for p in points]
    assert [p.realised for p in points] == realised
    assert {p.realised for p in points} - {0}, "want some accepted continuation in this test"
    classes = [r.hrad_class for r in survived]
    if policy.startswith("oracle"):
        assert classes == [true_class(n, gamma) for n in realised]
    else:
        assert set(classes) == {int(policy[-1])}
    if policy == "oracle_keep":
        assert [r.keep for r in survived] == realised
        # every kept token is accepted next round: what rolls back is only branch-point tokens
        for before, after in zip(rounds, rounds[1:]):
            assert after.pending_accepted == before.pending
    metrics = algo.extra_metrics()
    assert metrics["hrad_policy"] == policy and metrics["oracle_target_forwards"] == len(points)
    assert result.stats.target_forwards == len(rounds)  # the oracle's passes are not in τ


def test_on_branch_reports_hrad_inputs_and_changes_nothing(pair):
    """The hook's hidden states are HF hidden_states[-4:] at the position before the survivor token; with it on,
    greedy and seeded T = 1 outputs are those without it (the extra pass and its draws leave the run alone)."""
    from core.drafters.hrad import capture_layers

    target, draft = pair
    layers = capture_layers(2, 2)  # the 2-layer target: output of layer 0, then the final-normed state
    points = []
    hooked = specbranch(target, draft, gamma=4, kmax=3, on_branch=points.append, branch_capture_layers=layers)
    plain = specbranch(target, draft, gamma=4, kmax=3)
    assert hooked.generate(PROMPT, max_new_tokens=30, sampling=GREEDY).tokens == ar_tokens(target, 30)
    assert points and all(p.hrad_class == 1 for p in points)
    for point in points[:5]:
        assert len(point.tokens) == len(point.confidence) == 4
        sequence = PROMPT + ar_tokens(target, point.position - len(PROMPT) + 1)
        assert sequence[point.position] == point.tokens[0]
        with torch.no_grad():
            states = target(torch.tensor([sequence[: point.position]]), output_hidden_states=True).hidden_states
        torch.testing.assert_close(point.hidden[layers[0]], states[-2][0, -1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(point.last_hidden, states[-1][0, -1], atol=1e-4, rtol=1e-4)
    hot = SamplingParams(1.0)
    for seed in (3, 4):
        a = hooked.generate(PROMPT, max_new_tokens=20, sampling=hot, generator=torch.Generator().manual_seed(seed))
        b = plain.generate(PROMPT, max_new_tokens=20, sampling=hot, generator=torch.Generator().manual_seed(seed))
        assert a.tokens == b.tokens


@pytest.mark.parametrize("path", ["input", "logit"])
def test_confidence_feature_reaches_the_predictor(pair, path):
    """An H-RAD with confidence_feature gets the draft's confidence at the first continuation token, whichever path
    (MLP input or its own linear path to the logits) it takes inside."""
    from core.drafters.hrad import HRAD, HRADConfig, HRADPredictor, capture_layers

    target, draft = pair
    config = HRADConfig(
        hidden_size=32, last_k=2, gamma=4, boundaries=[1, 3], confidence_feature=True, confidence_path=path
    )
    real = HRADPredictor(HRAD(config), {"layers": {"ids": capture_layers(2, 2)}})
    seen, points = [], []

    class Recording:
        capture_layers, confidence_feature = real.capture_layers, True

        def predict(self, hidden_lastk, token_emb, confidence=None):
            seen.append(confidence)
            return real.predict(hidden_lastk, token_emb, confidence)

    algo = specbranch(target, draft, gamma=4, kmax=3, hrad=Recording(), on_branch=points.append)
    assert algo.generate(PROMPT, max_new_tokens=20, sampling=GREEDY).tokens == ar_tokens(target, 20)
    assert len(seen) == len(points) > 0
    assert [float(c[0]) for c in seen] == [p.confidence[1] for p in points]
    with pytest.raises(ValueError, match=r"pass confidence=\[1\]"):
        real.predict(torch.randn(1, 2, 32), torch.randn(1, 32))


def test_oracle_policies_refuse_sampling_in_one_line(pair):
    from inference import evaluate as evaluate_cli
    from inference.engine_args import check_algorithm_options

    target, draft = pair
    algo = specbranch(target, draft, hrad="oracle")
    with pytest.raises(ValueError, match="hrad=oracle needs temperature=0") as info:
        algo.generate(PROMPT, max_new_tokens=4, sampling=SamplingParams(1.0), generator=torch.Generator())
    assert "\n" not in str(info.value)
    cfg = evaluate_cli.parse_args(["algorithms=[specbranch]", "drafter=/models/draft"])
    check_algorithm_options(cfg, [], ["specbranch@hrad=oracle", "specbranch@hrad=class0"])  # T = 0: fine
    with pytest.raises(OverrideError, match=r"'specbranch@hrad=oracle_keep@temperature=1': hrad=oracle_keep needs"):
        check_algorithm_options(cfg, [], ["specbranch@hrad=oracle_keep@temperature=1"])
    with pytest.raises(OverrideError, match="hrad=oracle needs temperature=0") as info:  # refused while parsing
        evaluate_cli.parse_args(
            ["algorithms=[specbranch]", "drafter=/models/draft", "temperature=0.7", "specbranch.hrad=oracle"]
        )
    assert "\n" not in str(info.value)


def test_sps_gamma_7_runs_beside_gamma_4(pair):
    """``sps@gamma=7`` is a variant of its own beside ``sps`` (γ = 4): both pass the option checks, build with
    their own γ, and give AR's greedy tokens."""
    from inference import evaluate as evaluate_cli
    from inference.engine_args import check_algorithm_options, with_overrides

    labels = ["sps@draft_vocab=64", "sps@draft_vocab=64@gamma=7"]
    cfg = evaluate_cli.parse_args([f"algorithms=[{','.join(labels)}]", "drafter=/models/draft"])
    check_algorithm_options(cfg, [], labels)
    target, draft = pair
    for label, gamma in zip(labels, (4, 7)):
        options = OmegaConf.to_object(with_overrides(cfg, label.split("@")[1:], label).sps)
        assert options.gamma == gamma
        algo = build_algorithm("sps", runner(target), runner(draft), options)
        result = algo.generate(PROMPT, max_new_tokens=30, sampling=GREEDY)
        assert result.tokens == ar_tokens(target, 30) and len(result.stats.attempted_at) == gamma


def test_cut_from_the_first_continuation_token_is_lossless_and_keeps_less(pair):
    """specbranch_cut_from=1: the confidence rule may keep no continuation token; greedy output stays AR's, and
    it never keeps more than the authors' rule (cut_from=2) on the same survivor."""
    target, draft = pair
    for eps in (0.3, 0.9):
        rounds, points = [], []
        algo = specbranch(target, draft, rounds, gamma=4, kmax=3, epsilon=eps, cut_from=1, on_branch=points.append)
        assert algo.generate(PROMPT, max_new_tokens=30, sampling=GREEDY).tokens == ar_tokens(target, 30)
        for point in points:
            assert point.keep == continuation_to_keep(1, list(point.confidence), eps, cut_from=1)
            assert point.keep <= continuation_to_keep(1, list(point.confidence), eps)
    assert any(p.keep == 0 for p in points)  # ε = 0.9: some first continuation tokens are below it
    from inference import evaluate as evaluate_cli

    cfg = evaluate_cli.parse_args(["algorithms=[specbranch]", "drafter=/models/draft", "specbranch.cut_from=1"])
    assert cfg.specbranch.cut_from == 1
