"""The table of drafter kinds (``core.drafters.kinds``, docs/drafter_kinds.md): a kind defined in the test folder
(``toy_kind``) joins by one line of the table, trains with ``spectrain.fit``, exports with ``spectrain.export`` and
is served by the engine losslessly (greedy = AR) through an existing algorithm, without a library file knowing it; every kind of the
table has both halves; ``drafter=`` / ``drafter.<kind>=`` route paths by kind, and the old per-kind keys still work
with a warning naming the new spelling."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny_targets import save_tiny_target

from core.drafters import kinds
from core.overrides import OverrideError
from inference import evaluate as evaluate_cli
from inference.algorithms import serving_algorithms
from inference.engine_args import build_algorithms, drafter_paths, load_target
from inference.sampling import SamplingParams
from spectrain import export as export_cli
from spectrain import fit as fit_cli
from spectrain.registry import get_kind

REPO = Path(__file__).resolve().parents[2]
TOY_RECIPE = """# @package _global_
kind: toy_head
run_name: toy_head
model:
  sequences: 16
  length: 12
optim:
  lr: 0.05
data:
  batch_size: 8
trainer:
  max_steps: 4
  checkpoint_every_n_steps: 4
  monitor: ""
  accelerator: cpu
  devices: 1
"""


@pytest.fixture()
def toy_kind(monkeypatch):
    """The toy kind's one line in the table, for this test only."""
    monkeypatch.setitem(kinds.KIND_MODULES, "toy_head", ("toy_kind", "toy_kind"))


def test_a_kind_from_the_test_folder_trains_exports_and_serves_losslessly(toy_kind, tmp_path, monkeypatch):
    target = save_tiny_target(tmp_path / "target", layers=2, hidden=16)
    recipes = tmp_path / "recipes"
    (recipes / "recipe").mkdir(parents=True)
    shutil.copy(REPO / "recipes" / "config.yaml", recipes / "config.yaml")
    (recipes / "recipe" / "toy_head.yaml").write_text(TOY_RECIPE)
    trained = fit_cli.fit(
        fit_cli.compose_recipe(
            ["recipe=toy_head", f"target={target}", f"runs_dir={tmp_path / 'runs'}"], directory=recipes
        )
    )
    assert trained["trained"] and trained["global_step"] == 4

    ckpt = tmp_path / "runs" / "toy_head" / "checkpoints" / "last.ckpt"
    loads, load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda f, *a, **kw: loads.append(f) or load(f, *a, **kw))
    assert export_cli.main([f"ckpt={ckpt}", f"out={tmp_path / 'export'}"]) == 0
    assert [str(f) for f in loads] == [str(ckpt)]  # read once: for its kind and for its tensors
    monkeypatch.setattr(torch, "load", load)
    assert json.loads((tmp_path / "export" / "config.json").read_text())["spectrain"]["kind"] == "toy_head"
    assert serving_algorithms("toy_head") == ["eagle3_tree"]  # it serves as an EAGLE-3 drafter

    cfg = evaluate_cli.parse_args(
        [
            f"target={target}",
            f"drafter={tmp_path / 'export'}",
            "algorithms=eagle3_tree",
            "tree_depth=1",
            "tree_topk=4",
            "tree_total=5",
            "max_seq_len=64",
            "device=cpu",
        ]
    )
    assert drafter_paths(cfg) == {"toy_head": str(tmp_path / "export")}  # routed by the kind its export records
    target_lm = load_target(cfg)
    _, built = build_algorithms(cfg, ["ar", "eagle3_tree"], target_lm)
    (ar, _), (tree, _) = built["ar"], built["eagle3_tree"]
    assert (type(tree.drafter).__module__, type(tree.drafter).__name__) == ("toy_kind", "ToyHeadDrafter")
    drafted = 0
    for prompt in ("Once upon a time", "The capital of France is"):
        ids = target_lm.tokenizer(prompt)["input_ids"]
        want = ar.generate(ids, max_new_tokens=12, sampling=SamplingParams(0.0)).tokens
        got = tree.generate(ids, max_new_tokens=12, sampling=SamplingParams(0.0))
        assert got.tokens == want  # greedy: the target's own tokens, whatever the head drafts
        drafted += got.stats.drafted_tokens
    assert drafted > 0


def test_every_kind_of_the_table_has_both_halves():
    for name in kinds.KIND_MODULES:
        engine, training = kinds.engine_kind(name), get_kind(name)
        assert engine.name == training.name == name and training.export_checkpoint is not None
        assert engine.load is not None or name == kinds.CAUSAL_LM_KIND  # a causal LM runs on a runner of its own
    assert serving_algorithms("eagle3") == ["eagle3_tree"] and "sps" in serving_algorithms("draft_lm")


def _export_dir(path: Path, kind: str) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"spectrain": {"kind": kind}}))
    return path


def test_drafter_paths_by_kind_and_the_old_keys(tmp_path):
    eagle3, dflash = _export_dir(tmp_path / "e3", "eagle3"), _export_dir(tmp_path / "df", "dflash")
    cfg = evaluate_cli.parse_args([f"drafter={eagle3}", f"drafter.dflash={dflash}", "drafter.draft_lm=smollm2"])
    assert drafter_paths(cfg) == {"eagle3": str(eagle3), "dflash": str(dflash), "draft_lm": "smollm2"}
    with pytest.warns(FutureWarning, match=r"feature_drafter= is spelt drafter.eagle3= now"):
        cfg = evaluate_cli.parse_args([f"feature_drafter={eagle3}"])
    assert drafter_paths(cfg) == {"eagle3": str(eagle3)}
    with pytest.raises(OverrideError, match=r"drafter.eagle=.*unknown drafter kind 'eagle'; write drafter.KIND=PATH"):
        evaluate_cli.parse_args([f"drafter.eagle={eagle3}"])
