"""``model.objective=accept``: the expected accepted length equals its formula computed by hand, its gradient raises
the acceptance, and a recipe with it trains, checkpoints, resumes, exports and serves losslessly."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch
from eagle3_training_builders import eagle3_fit_setup
from transformers import LlamaConfig

from core.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from core.drafters.eagle3.kind import load_eagle3
from inference.algorithms import build_algorithm
from inference.drafters import load_lm
from inference.sampling import SamplingParams
from spectrain import export as export_cli
from spectrain import fit as fit_cli
from spectrain.kinds.eagle3.losses import acceptance_term, expected_accepted_length, scored_rows, teacher_rows, ttt_loss


def test_expected_accepted_length_equals_the_formula_by_hand():
    torch.manual_seed(0)
    shape, vocab = (2, 6), 5
    scored = [  # step j's rows (batch, row); a chain breaks where a later step does not score its row
        [(0, 0), (0, 1), (0, 2), (1, 0), (1, 3)],
        [(0, 0), (0, 2), (1, 0), (1, 3)],
        [(0, 0), (1, 0), (1, 3), (1, 4)],
    ]
    students = [torch.randn(len(r), vocab) for r in scored]
    teachers = [torch.randn(len(r), vocab).softmax(-1) for r in scored]
    rows = [(torch.tensor([b for b, _ in r]), torch.tensor([i for _, i in r])) for r in scored]
    got = expected_accepted_length(students, teachers, rows, shape)

    def alpha(j: int, start: tuple[int, int]) -> float:
        if start not in scored[j]:
            return 0.0
        n = scored[j].index(start)
        q = np.exp(students[j][n].double().numpy())
        q /= q.sum()
        return float(np.minimum(q, teachers[j][n].double().numpy()).sum())

    lengths = [sum(np.prod([alpha(j, s) for j in range(k + 1)]) for k in range(3)) for s in scored[0]]
    assert got.item() == pytest.approx(float(np.mean(lengths)), rel=1e-5)
    assert 0.0 < got.item() < 3.0
    assert acceptance_term(got, 3).item() == pytest.approx(-np.log(np.mean(lengths) / 3), rel=1e-5)


def tiny_drafter_batch():
    torch.manual_seed(0)
    target = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        num_hidden_layers=4,
    )
    drafter = Eagle3Drafter(
        Eagle3Config.for_target(target, draft_vocab_size=64, aux_layer_ids=[0, 1, 2]), torch.randn(64, 32)
    )
    ids = torch.randint(0, 64, (4, 16))
    aux, last = torch.randn(4, 16, 96), torch.randn(4, 16, 32)
    supervised = torch.ones(4, 16, dtype=torch.bool)
    supervised[:, :3] = False
    weight = torch.randn(64, 32) * 2
    return drafter, ids, aux, last, supervised, lambda h: h @ weight.T


def chain(drafter, ids, aux, last, supervised, project, steps):
    hidden = drafter(ids, aux, steps=steps, heads=False).hidden
    index, probs = teacher_rows(project, last, supervised, drafter.t2d)
    out = []
    for j in range(steps):
        b, i, n = scored_rows(index, j)
        out.append((drafter.head(hidden[j][b, i]), probs[n], (b, i)))
    return tuple(zip(*out))


def test_the_objective_gradient_raises_the_acceptance():
    """Adam on the objective's term alone, from a random drafter: the gradient is finite and the step-0 acceptance
    α and the expected accepted length both rise."""
    drafter, ids, aux, last, supervised, project = tiny_drafter_batch()
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-3)

    def measure():
        students, teachers, rows = chain(drafter, ids, aux, last, supervised, project, 3)
        alpha0 = torch.minimum(students[0].softmax(-1), teachers[0]).sum(-1).mean()
        return expected_accepted_length(students, teachers, rows, ids.shape), alpha0

    with torch.no_grad():
        before, alpha_before = measure()
    for _ in range(15):
        optimizer.zero_grad()
        accepted, _ = measure()
        acceptance_term(accepted, 3).backward()
        grads = [p.grad for p in drafter.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
        optimizer.step()
    with torch.no_grad():
        after, alpha_after = measure()
    assert alpha_after > alpha_before + 0.05
    assert after > before + 0.05


def test_the_objective_added_to_the_cross_entropy_keeps_its_gradient_finite():
    drafter, ids, aux, last, supervised, project = tiny_drafter_batch()
    students, teachers, rows = chain(drafter, ids, aux, last, supervised, project, 3)
    masks = [torch.ones(len(s), dtype=torch.bool) for s in students]
    loss = ttt_loss(students, teachers, masks, step_weight=0.8)[0]
    loss = loss + 2.0 * acceptance_term(expected_accepted_length(students, teachers, rows, ids.shape), 3)
    loss.backward()
    assert torch.isfinite(loss) and all(
        torch.isfinite(p.grad).all() for p in drafter.parameters() if p.grad is not None
    )


def test_objective_accept_trains_resumes_exports_and_serves_losslessly(tmp_path):
    recipes, args, target = eagle3_fit_setup(tmp_path, chats=40, samples=16, steps=2, every=2, warmup=1)
    args = [*args, "objective=accept", "accept_weight=2.0"]
    cfg = fit_cli.compose_recipe(args, directory=recipes)
    assert cfg.model.objective == "accept" and cfg.model.accept_weight == 2.0
    assert fit_cli.fit(cfg)["global_step"] == 2
    resumed = fit_cli.fit(fit_cli.compose_recipe([*args, "max_steps=4", "resume=auto"], directory=recipes))
    assert resumed["trained"] and resumed["global_step"] == 4
    assert 1.0 <= resumed["metrics"]["val/tau_sim_t1"] <= 1.0 + cfg.model.gamma
    run = tmp_path / "runs" / "eagle3_smollm2"
    launches = sorted(run.glob("logs/version_*/metrics.csv"))
    assert len(launches) == 2
    steps = [[int(r["step"]) for r in csv.DictReader(p.open()) if r.get("train/accepted_length")] for p in launches]
    assert steps == [[0, 1], [2, 3]]  # the resumed launch continues at step 2, the objective logged in both

    ckpt = run / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, weights_only=False)["spectrain"]["recipe"]["model"]["objective"] == "accept"
    assert export_cli.main([f"ckpt={ckpt}", "format=native", f"out={tmp_path / 'native'}"]) == 0
    target_lm = load_lm(str(target), max_seq_len=128)
    drafter = load_eagle3(str(tmp_path / "native"), target_lm)
    greedy = SamplingParams(0.0)
    prompt = [1, 2, 3, 4, 5]
    reference = build_algorithm("ar", target_lm.runner).generate(prompt, max_new_tokens=12, sampling=greedy)
    tree = build_algorithm("eagle3_tree", target_lm.runner, drafter, tree_depth=3, tree_topk=2, tree_total=8)
    assert tree.generate(prompt, max_new_tokens=12, sampling=greedy).tokens == reference.tokens


@pytest.fixture(scope="module")
def small_setup(tmp_path_factory):
    return eagle3_fit_setup(tmp_path_factory.mktemp("bad_objective"), chats=8, samples=4)


@pytest.mark.parametrize(
    "override, message",
    [
        ("objective=lk", "model.objective=lk is not one of kl, accept"),
        ("accept_weight=0", "model.accept_weight=0.0 must be a finite number > 0"),
        ("accept_weight=-1", "model.accept_weight=-1.0 must be a finite number > 0"),
        ("accept_weight=nan", "model.accept_weight=nan must be a finite number > 0"),
    ],
)
def test_bad_objective_values_are_refused_in_one_line(small_setup, override, message):
    recipes, args, _ = small_setup
    cfg = fit_cli.compose_recipe([*args, override, "dry_run=true"], directory=recipes)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")) as info:
        fit_cli.fit(cfg)
    assert "\n" not in str(info.value)
