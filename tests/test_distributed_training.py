"""Training on several processes, on CPU over gloo, started by Lightning's own launcher (``python -m spectrain.fit
... trainer.devices=2``): 2 processes with a per-process batch of b end with the weights of 1 process with batch 2b,
for every kind under DDP, for SpecBlock under FSDP (sharded checkpoints, killed, resumed, exported) and for EAGLE-3
under DeepSpeed ZeRO-3; a DDP run whose launcher is killed with SIGKILL mid-epoch resumes (``resume=auto``) to the
uninterrupted run's weights bit for bit.

Tolerance: the per-process losses are means over the global batch (``core.distributed.process_mean``) and DDP
averages the gradients, so the two trainings differ only in float summation order. AdamW divides each gradient by
its own running scale, so a rounding difference in a near-zero gradient can move that weight by a fraction of a
step: |Δw| <= 1e-4 + 1e-4·|w|, a hundredth of one step at lr 1e-2 (seen: at most 2e-5, on 1 of 40,960 weights)."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_targets import save_tiny_target, write_jsonl

from spectrain import fit as fit_cli

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
ATOL, RTOL = 1e-4, 1e-4
B = 2  # the per-process batch; the single-process reference trains on 2 * B
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target with a sharpened head, chats, an extracted feature set and acceptance traces."""
    from data_prep.extract import extract, parse_args
    from data_prep.traces import parse_args as trace_args
    from data_prep.traces import record_traces

    root = tmp_path_factory.mktemp("ddp")
    # A random tiny target is nearly uniform; its head sharpened 30x, there is something to learn.
    target = save_tiny_target(root / "target", layers=4, hidden=32, logit_scale=30.0)
    draft = save_tiny_target(root / "draft", layers=4, noise=0.002)
    chats = write_jsonl(root / "chats.jsonl", 48)
    extract(parse_args([f"target={target}", f"source=jsonl:{chats}", "n_samples=24", "max_len=48", "layers=[0,1,2]",
                        "dtype=fp32", "batch_size=8", f"out={root / 'feats'}"]))
    record_traces(trace_args([f"target={target}", f"drafter={draft}", f"source=jsonl:{chats}", "n_samples=12",
                              "gamma=4", "max_new_tokens=16", "max_seq_len=128", "device=cpu",
                              f"out={root / 'traces'}"]))
    recipes = root / "recipes"
    shutil.copytree(REPO / "recipes", recipes)
    return root


def kind_args(root: Path, kind: str) -> list[str]:
    """The kind's CPU recipe on the tiny setup: 6 steps (a checkpoint every 2), per-process batch B."""
    common = [f"target={root / 'target'}", "max_steps=6", "val_check_interval=6", "checkpoint_every_n_steps=2",
              "warmup_steps=2", "log_every_n_steps=1", "logger=csv", "trainer.accelerator=cpu"]
    online = [f"source=jsonl:{root / 'chats.jsonl'}", "n_samples=24", "n_val_samples=4", "max_len=48"]
    return {
        "draft_lm": ["recipe=draftlm_smollm2", *online, "num_layers=2", "lr=1e-2"],
        "eagle3": ["recipe=eagle3_smollm2", *online, "draft_vocab_size=512", "ttt_steps=3", "gamma=2",
                   "layers=[0,1,2]", "lr=5e-3"],
        "specblock": ["recipe=specblock_smollm2", f"source=jsonl:{root / 'chats.jsonl'}", "n_samples=24",
                      "max_len=48", f"dataset_dir={root / 'feats'}", f"val_dataset_dir={root / 'feats'}",
                      "draft_vocab_size=512", "layers=[0,1,2]", "lr=5e-3"],
        "hrad": ["recipe=hrad_smollm2", f"dataset_dir={root / 'traces'}", "val_fraction=0.25", "lr=1e-2",
                 "model.dropout=0.0"],  # dropout masks are drawn per process: another batch, other masks
    }[kind] + common


def launch(args: list[str], runs: Path, recipes: Path, strategy: str = "ddp") -> subprocess.Popen:
    """``python -m spectrain.fit ... trainer.devices=2 trainer.strategy=ddp``: Lightning starts the second
    process itself (it re-runs this command with LOCAL_RANK=1)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", SPECTRAIN_RECIPES=str(recipes), DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "spectrain.fit", *args, f"batch_size={B}", "trainer.devices=2",
           f"trainer.strategy={strategy}", f"runs_dir={runs}"]
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)  # its own group: a leftover rank can be reaped by the test


def finish(proc: subprocess.Popen, timeout: float = 300) -> None:
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err.decode()[-3000:]


def last_weights(runs: Path) -> dict[str, torch.Tensor]:
    (run,) = [p for p in runs.iterdir() if p.is_dir()]
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]


def single_process_run(root: Path, kind: str) -> Path:
    """The 1-process run of ``kind`` with batch 2B (the reference of every multi-process run)."""
    runs = root / f"single_{kind}"
    if not runs.exists():
        cfg = fit_cli.compose_recipe([*kind_args(root, kind), f"batch_size={2 * B}", "trainer.devices=1",
                                      f"runs_dir={runs}"], directory=root / "recipes")
        assert fit_cli.fit(cfg)["global_step"] == 6
    return runs


def kill_after(proc: subprocess.Popen, marker: Path) -> None:
    """SIGKILL the launcher (rank 0) and its worker at once, as a node failure does, once ``marker`` (a checkpoint)
    exists."""
    deadline = time.monotonic() + 240
    while not marker.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, f"no {marker.name} after 240 s"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    reap_group(proc.pid, grace=5.0)


@functools.cache
def two_process_run(root: Path, kind: str) -> Path:
    """The uninterrupted 2-process run of ``kind`` (shared by the equality and the resume test)."""
    runs = root / f"ddp_{kind}"
    finish(launch(kind_args(root, kind), runs, root / "recipes"))
    return runs


@pytest.mark.parametrize("kind", ["draft_lm", "eagle3", "specblock", "hrad"])
def test_two_ddp_processes_with_batch_b_train_like_one_process_with_batch_2b(setup, kind):
    ddp = last_weights(two_process_run(setup, kind))
    single = last_weights(single_process_run(setup, kind))
    assert ddp.keys() == single.keys() and ddp
    early = early_weights(setup, kind)
    changed = 0
    for name, value in single.items():
        if name == "drafter.temperature":  # fitted after training by LBFGS on a 3-round validation NLL that is
            continue  # flat here (T runs off to ~1e6): its end point is not a function of the weights
        torch.testing.assert_close(ddp[name], value, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")
        changed += not torch.equal(value, early[name])
    assert changed, "nothing trained"


def early_weights(root: Path, kind: str) -> dict[str, torch.Tensor]:
    """The weights at step 2 of the single run: the test must compare trained weights, not initial ones."""
    (run,) = [p for p in (root / f"single_{kind}").iterdir() if p.is_dir()]
    return torch.load(run / "checkpoints" / "step2.ckpt", weights_only=False)["state_dict"]


def reap_group(group: int, grace: float = 10.0) -> None:
    """Wait until every process of a killed launch is gone; SIGKILL what is left after ``grace`` seconds."""
    deadline = time.monotonic() + grace
    try:
        while time.monotonic() < deadline:
            os.killpg(group, 0)
            time.sleep(0.1)
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_killed_two_process_run_resumes_to_the_uninterrupted_weights(setup):
    kind, runs = "eagle3", setup / "ddp_killed"
    args = kind_args(setup, kind)
    kill_after(launch(args, runs, setup / "recipes"), runs / "eagle3_smollm2" / "checkpoints" / "step2.ckpt")
    stopped = torch.load(fit_cli.latest_checkpoint(runs / "eagle3_smollm2"), weights_only=False)["global_step"]
    assert 2 <= stopped < 6
    finish(launch([*args, "resume=auto"], runs, setup / "recipes"))
    resumed, uninterrupted = last_weights(runs), last_weights(two_process_run(setup, kind))
    assert resumed.keys() == uninterrupted.keys()
    for name, value in uninterrupted.items():
        assert torch.equal(resumed[name], value), name


def test_fsdp_on_two_processes_saves_sharded_resumes_and_exports_the_single_process_tensors(setup, tmp_path):
    """trainer.strategy=fsdp (FSDP2 over gloo): the launcher is killed after the first sharded checkpoint, the run
    resumes from it (resume=auto), and its export equals the export of 1 process with batch 2B."""
    from spectrain import export as export_cli

    kind, runs = "specblock", setup / "fsdp"
    args = kind_args(setup, kind)
    checkpoints = runs / "specblock_smollm2" / "checkpoints"
    kill_after(launch(args, runs, setup / "recipes", strategy="fsdp"), checkpoints / "step2.ckpt")
    assert export_cli.is_sharded_checkpoint(checkpoints / "step2.ckpt")  # one directory, a shard per process
    finish(launch([*args, "resume=auto"], runs, setup / "recipes", strategy="fsdp"))
    assert export_cli.is_sharded_checkpoint(checkpoints / "last.ckpt")

    def exported(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
        assert export_cli.main([f"ckpt={ckpt}", "format=native", f"out={out}"]) == 0
        return load_file(out / "model.safetensors")

    sharded = exported(checkpoints / "last.ckpt", tmp_path / "fsdp_export")
    single = exported(single_process_run(setup, kind) / "specblock_smollm2" / "checkpoints" / "last.ckpt",
                      tmp_path / "single_export")
    assert sharded.keys() == single.keys() and sharded
    for name, value in single.items():
        torch.testing.assert_close(sharded[name], value, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("stage", [3])
def test_deepspeed_zero_on_two_cpu_processes_trains_like_one_process(setup, stage, tmp_path):
    """DeepSpeed's CPU accelerator (DS_ACCELERATOR=cpu) communicates over gloo: ZeRO-3 (parameters, gradients and
    optimizer state partitioned) trains on 2 processes, and its consolidated weights equal 1 process with batch 2B."""
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    kind, runs = "eagle3", setup / f"zero{stage}"
    finish(launch(kind_args(setup, kind), runs, setup / "recipes", strategy=f"deepspeed_stage_{stage}"))
    checkpoint = runs / "eagle3_smollm2" / "checkpoints" / "last.ckpt"
    assert checkpoint.is_dir()  # DeepSpeed's own partitioned layout
    convert_zero_checkpoint_to_fp32_state_dict(str(checkpoint), str(tmp_path / "full.ckpt"))
    zero = torch.load(tmp_path / "full.ckpt", weights_only=False)
    assert zero["global_step"] == 6
    single = last_weights(single_process_run(setup, kind))
    for name, value in single.items():
        torch.testing.assert_close(zero["state_dict"][name], value, atol=ATOL, rtol=RTOL,
                                   msg=lambda m, n=name: f"{n}: {m}")
