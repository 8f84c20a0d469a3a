"""Exact resume: a run killed with SIGKILL between checkpoints and restarted with ``resume=auto`` ends bit for bit
where an uninterrupted run ends (weights, optimizer state, loss trajectory); checkpoints are written atomically."""

from __future__ import annotations

import csv
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fit_recipes import TOY_RECIPE  # importing it registers the kind toy_regression

from spectrain import fit as fit_cli
from spectrain import resume

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]
BATCHES_PER_EPOCH = 4  # the toy data: 64 rows, batch_size 16
# dropout > 0: the steps draw from the global RNG, so a resume that does not restore it diverges at once.
RUN = [
    "recipe=toy",
    "max_steps=20",
    "checkpoint_every_n_steps=3",
    "model.dropout=0.3",
    "log_every_n_steps=1",
    "val_check_interval=5",
]


@pytest.fixture()
def recipes(tmp_path: Path) -> Path:
    directory = tmp_path / "recipes"
    (directory / "recipe").mkdir(parents=True)
    shutil.copy(REPO / "recipes" / "config.yaml", directory / "config.yaml")
    (directory / "recipe" / "toy.yaml").write_text(TOY_RECIPE)
    return directory


def train_losses(run: Path) -> dict[int, float]:
    """step -> train/loss over every launch of a run (CSVLogger writes one version_N per launch)."""
    losses = {}
    for metrics in sorted(run.glob("logs/version_*/metrics.csv")):
        for row in csv.DictReader(metrics.open()):
            if row.get("train/loss"):
                losses[int(row["step"])] = float(row["train/loss"])
    return losses


def kill_after_checkpoint(recipes: Path, runs: Path, step: int) -> None:
    """Run ``python -m spectrain.fit`` (slowed to 0.1 s a step) and SIGKILL it once ``step{step}.ckpt`` exists."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        SPECTRAIN_RECIPES=str(recipes),
        SPECTRAIN_KIND_MODULES="fit_recipes",  # registers kind toy_regression in the child
        PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "spectrain.fit", *RUN, f"runs_dir={runs}", "model.step_seconds=0.1"],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    marker = runs / "toy" / "checkpoints" / f"step{step}.ckpt"
    deadline = time.monotonic() + 120
    while not marker.exists():
        if proc.poll() is not None:
            pytest.fail(
                f"training exited (rc {proc.returncode}) before step {step}: {proc.stderr.read().decode()[-2000:]}"
            )
        assert time.monotonic() < deadline, f"no {marker.name} after 120 s"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL


def test_sigkill_mid_epoch_then_resume_auto_matches_an_uninterrupted_run(recipes, tmp_path):
    killed, reference = tmp_path / "killed", tmp_path / "reference"
    kill_after_checkpoint(recipes, killed, step=6)
    latest = torch.load(resume.latest_checkpoint(killed / "toy"), weights_only=True)  # what resume=auto loads
    resumed_from = latest["global_step"]
    # The kill landed mid-run and mid-epoch: the loader position inside the epoch is part of the checkpoint.
    assert 6 <= resumed_from < 20 and resumed_from % BATCHES_PER_EPOCH != 0
    loader_state = latest["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert loader_state["_num_yielded"] == resumed_from % BATCHES_PER_EPOCH

    resumed = fit_cli.fit(fit_cli.compose_recipe([*RUN, f"runs_dir={killed}", "resume=auto"], directory=recipes))
    uninterrupted = fit_cli.fit(fit_cli.compose_recipe([*RUN, f"runs_dir={reference}"], directory=recipes))
    assert resumed["global_step"] == uninterrupted["global_step"] == 20

    assert_same_final_state(killed, reference)
    a = torch.load(killed / "toy" / "checkpoints" / "last.ckpt", weights_only=True)
    b = torch.load(reference / "toy" / "checkpoints" / "last.ckpt", weights_only=True)
    assert a["global_step"] == 20
    for x, y in zip(a["optimizer_states"][0]["state"].values(), b["optimizer_states"][0]["state"].values()):
        assert all(torch.equal(x[k], y[k]) for k in x)
    losses, expected = train_losses(killed / "toy"), train_losses(reference / "toy")
    assert len(expected) == 20
    after = {s: v for s, v in expected.items() if s >= resumed_from}
    assert {s: losses[s] for s in after} == after  # the whole trajectory after the resume point, exactly


def assert_same_final_state(run: Path, reference: Path) -> None:
    a = torch.load(run / "toy" / "checkpoints" / "last.ckpt", weights_only=True)
    b = torch.load(reference / "toy" / "checkpoints" / "last.ckpt", weights_only=True)
    assert a["global_step"] == b["global_step"]
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for name in a["state_dict"]:
        assert torch.equal(a["state_dict"][name], b["state_dict"][name]), name


def test_a_finished_run_extended_with_more_steps_matches_the_longer_run(recipes, tmp_path):
    # max_steps=5 is no multiple of the interval 3: the final step is saved in the loop, like periodic ones.
    short = [*RUN, "max_steps=5", f"runs_dir={tmp_path / 'extended'}"]
    assert fit_cli.fit(fit_cli.compose_recipe(short, directory=recipes))["global_step"] == 5
    last = tmp_path / "extended" / "toy" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 5
    extended = [*RUN, "max_steps=10", f"runs_dir={tmp_path / 'extended'}", "resume=auto"]
    assert fit_cli.fit(fit_cli.compose_recipe(extended, directory=recipes))["global_step"] == 10
    fit_cli.fit(fit_cli.compose_recipe([*RUN, "max_steps=10", f"runs_dir={tmp_path / 'reference'}"], directory=recipes))
    assert_same_final_state(tmp_path / "extended", tmp_path / "reference")


def test_killed_checkpoint_write_keeps_the_previous_file(tmp_path, monkeypatch):
    *_, atomic_io = resume.resume_classes()
    path = tmp_path / "checkpoints" / "last.ckpt"
    atomic_io().save_checkpoint({"global_step": 3}, path)

    def dies_mid_write(obj, handle):
        handle.write(b"half a checkpoint")
        raise KeyboardInterrupt  # stands in for the process dying inside torch.save

    monkeypatch.setattr(torch, "save", dies_mid_write)
    with pytest.raises(KeyboardInterrupt):
        atomic_io().save_checkpoint({"global_step": 6}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True) == {"global_step": 3}
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]


def test_resume_auto_takes_the_newest_step_or_last_checkpoint(tmp_path):
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    assert resume.latest_checkpoint(tmp_path) is None
    for age, name in enumerate(("best.ckpt", ".last.ckpt.tmp-x", "step12.ckpt", "last.ckpt", "step9.ckpt")):
        (ckpts / name).write_bytes(b"")
        os.utime(ckpts / name, ns=(age, 10**9 * (10 - age)))
    # best.ckpt and the half-written temporary are newest but never resumed; step12 (killed before last) is.
    assert resume.latest_checkpoint(tmp_path) == ckpts / "step12.ckpt"
    os.utime(ckpts / "last.ckpt", ns=(0, 10**9 * 8))  # written with step12 (same state): last.ckpt wins
    assert resume.latest_checkpoint(tmp_path) == ckpts / "last.ckpt"


def test_rng_states_round_trip_through_a_weights_only_load(tmp_path):
    import random

    import numpy as np

    states = resume.collect_rng_states()
    torch.save(states, tmp_path / "rng.pt")
    expected = (torch.rand(3), np.random.rand(3), random.random())
    resume.set_rng_states(torch.load(tmp_path / "rng.pt", weights_only=True))
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1]) and expected[2] == again[2]


def test_fsdp_checkpoint_replaces_last_ckpt_over_a_half_deleted_old_copy(tmp_path, monkeypatch):
    """An earlier kill mid-cleanup left ``.last.ckpt.old`` half deleted: the next sharded save still lands whole,
    and nothing else is left beside it (one process; the collectives are identities)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from spectrain.strategies import sharded_strategy_class

    def write_shards(self, checkpoint, path, storage_options=None):  # stands in for torch.distributed.checkpoint
        Path(path).mkdir()
        (Path(path) / "shard-0").write_text(str(checkpoint["global_step"]))

    monkeypatch.setattr(ModelParallelStrategy, "save_checkpoint", write_shards)
    strategy = sharded_strategy_class()()
    monkeypatch.setattr(strategy, "broadcast", lambda obj, src=0: obj)
    monkeypatch.setattr(strategy, "barrier", lambda *args, **kwargs: None)
    final = tmp_path / "last.ckpt"
    strategy.save_checkpoint({"global_step": 2}, final)
    leftover = tmp_path / ".last.ckpt.old" / "__0_0.distcp"  # what a kill inside rmtree leaves
    leftover.parent.mkdir()
    leftover.write_text("half deleted")
    strategy.save_checkpoint({"global_step": 4}, final)
    assert (final / "shard-0").read_text() == "4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
