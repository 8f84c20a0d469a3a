"""Training on several processes, on CPU over gloo, started by Lightning's own launcher: 2 processes with a
per-process batch of b end with the weights of 1 process with batch 2b, for every kind (and each GSM recipe's own
training path) under DDP, and the kinds that differ in what sharding must get right under FSDP and DeepSpeed
ZeRO-2/3 (every kind under every strategy with ``SPECTRAIN_TEST_FULL_MATRIX=1``). A 2-process run resumed from its
step-2 checkpoint ends on the uninterrupted run's weights bit for bit: under DDP (one file) and under FSDP (a sharded
directory, whose export equals the single-process tensors). What a SIGKILL leaves behind, and which checkpoint
``resume=auto`` takes, is ``tests/spectrain/test_resume.py``'s; checkpoint writes are rank 0's (DDP) or atomic per
directory (FSDP, DeepSpeed), so a kill leaves the same files whatever the process count.

Interpreter starts are most of a small multi-process run, so every run shares ONE launch (``tests/run_many.py``).
Validation does not touch the weights, so only the runs that exercise it under sharding validate (FSDP's sharded
SpecBlock runs, ZeRO-3's H-RAD, whose temperature is fitted on the validation set); the rest train only
(``trainer.limit_val_batches=0``), a third of a small run's time.

Tolerance: the per-process losses are means over the global batch (``core.distributed.process_mean``) and DDP
averages the gradients, so the two trainings differ only in float summation order. AdamW divides each gradient by
its own running scale, so a rounding difference in a near-zero gradient can move that weight by a fraction of a
step: |Δw| <= 1e-4 + 1e-4·|w|, a hundredth of one step at lr 1e-2 (seen in 6-step runs: at most 2e-5, on 1 of 40,960
weights)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_targets import save_tiny_target, write_jsonl

from spectrain import export as export_cli
from spectrain import fit as fit_cli

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]
ATOL, RTOL = 1e-4, 1e-4
B = 2  # the per-process batch; the single-process reference trains on 2 * B
STEPS = 3  # every run's length; the resumed runs start again after step 2
# An interval past max_steps: no periodic checkpoint, only last.ckpt after the final step (spectrain.resume's
# FinalStepCheckpoint). DeepSpeed and FSDP write a directory per checkpoint, a cost a run pays for nothing it reads.
FINAL_ONLY = 100
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


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
    extract(
        parse_args(
            [
                f"target={target}",
                f"source=jsonl:{chats}",
                "n_samples=24",
                "max_len=48",
                "layers=[0,1,2]",
                "dtype=fp32",
                "batch_size=8",
                f"out={root / 'feats'}",
            ]
        )
    )
    record_traces(
        trace_args(
            [
                f"target={target}",
                f"drafter={draft}",
                f"source=jsonl:{chats}",
                "n_samples=12",
                "gamma=4",
                "max_new_tokens=16",
                "max_seq_len=128",
                "device=cpu",
                f"out={root / 'traces'}",
            ]
        )
    )
    recipes = root / "recipes"
    shutil.copytree(REPO / "recipes", recipes)
    return root


def kind_args(root: Path, kind: str, checkpoint_every: int = 2, validate: bool = False) -> list[str]:
    """The kind's CPU recipe on the tiny setup: STEPS steps (a checkpoint every ``checkpoint_every``), per-process batch
    B, validating at the end only if ``validate``. A ``_gsm`` name is that kind's GSM recipe, on the same chats: it
    trains its own path (batches bucketed by length; the draft LM on the data's tokens with a truncated head,
    ``train_vocab``)."""
    common = [
        f"target={root / 'target'}",
        f"max_steps={STEPS}",
        f"val_check_interval={STEPS}",
        f"checkpoint_every_n_steps={checkpoint_every}",
        "warmup_steps=2",
        "log_every_n_steps=1",
        "logger=csv",
        "trainer.accelerator=cpu",
        *([] if validate else ["trainer.limit_val_batches=0"]),
    ]
    online = [f"source=jsonl:{root / 'chats.jsonl'}", "n_samples=24", "n_val_samples=4", "max_len=48"]
    eagle3 = ["draft_vocab_size=512", "ttt_steps=3", "gamma=2", "layers=[0,1,2]", "lr=5e-3"]
    dflash = ["draft_vocab_size=512", "block_size=4", "num_layers=1", "max_anchors=16", "layers=[0,1,2]", "lr=5e-3"]
    return {
        "draft_lm": ["recipe=draftlm_smollm2", *online, "num_layers=2", "lr=1e-2"],
        "draft_lm_gsm": ["recipe=draftlm_smollm2_gsm", *online, "num_layers=2", "lr=1e-2", "train_vocab=512"],
        "eagle3": ["recipe=eagle3_smollm2", *online, *eagle3],
        "eagle3_gsm": ["recipe=eagle3_smollm2_gsm", *online, *eagle3],
        "specblock": [
            "recipe=specblock_smollm2",
            f"source=jsonl:{root / 'chats.jsonl'}",
            "n_samples=24",
            "max_len=48",
            f"dataset_dir={root / 'feats'}",
            f"val_dataset_dir={root / 'feats'}",
            "draft_vocab_size=512",
            "layers=[0,1,2]",
            "lr=5e-3",
        ],
        "specblock_gsm": ["recipe=specblock_smollm2_gsm", *online, "draft_vocab_size=512", "layers=[0,1,2]", "lr=5e-3"],
        "hrad": [
            "recipe=hrad_smollm2",
            f"dataset_dir={root / 'traces'}",
            "val_fraction=0.25",
            "lr=1e-2",
            "model.dropout=0.0",
        ],  # dropout masks are drawn per process: another batch, other masks
        "dflash": ["recipe=dflash_smollm2", *online, *dflash],
        "dflash_gsm": ["recipe=dflash_smollm2_gsm", *online, *dflash],
    }[kind] + common


# What the shared launch trains, by strategy. Under DDP every kind and GSM recipe (the GSM recipes differ in their
# data path, not in what a strategy shards). Under FSDP and DeepSpeed ZeRO-2/3 the kinds whose modules differ in
# what sharding must get right (frozen weights shared with the target: EAGLE-3, DFlash, SpecBlock; a whole LM; a
# small classifier); SPECTRAIN_TEST_FULL_MATRIX=1 trains every kind under every strategy (about twice the time).
# specblock under fsdp is the run with sharded checkpoints that is resumed from step 2. DFlash draws each row's
# anchors from (seed, step, global row), so 2 x b processes draw what 1 x 2b draws and it is held to the same equality.
KINDS = (
    "draft_lm",
    "draft_lm_gsm",
    "eagle3",
    "eagle3_gsm",
    "specblock",
    "specblock_gsm",
    "hrad",
    "dflash",
    "dflash_gsm",
)
STRATEGIES = ("ddp", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3")
SHARDED_KINDS = {
    "fsdp": ("eagle3", "dflash"),
    "deepspeed_stage_2": ("draft_lm", "specblock"),
    "deepspeed_stage_3": ("eagle3", "dflash", "hrad"),
}
# The sharded runs that validate (with the FSDP SpecBlock runs of ``trained``): ZeRO-3 H-RAD fits its temperature on
# the validation set over partitioned parameters.
VALIDATED = {("deepspeed_stage_3", "hrad")}
if os.environ.get("SPECTRAIN_TEST_FULL_MATRIX") == "1":
    TRAINED = {strategy: tuple(k for k in KINDS if (strategy, k) != ("fsdp", "specblock")) for strategy in STRATEGIES}
else:
    TRAINED = {"ddp": KINDS, **SHARDED_KINDS}


def two_process_args(
    root: Path, kind: str, strategy: str, runs: Path, checkpoint_every: int = FINAL_ONLY, validate: bool = False
) -> list[str]:
    """``checkpoint_every=2`` for a run whose step-2 checkpoint a resume reads."""
    return [
        *kind_args(root, kind, checkpoint_every, validate),
        f"batch_size={B}",
        "trainer.devices=2",
        f"trainer.strategy={strategy}",
        f"runs_dir={runs}",
    ]


def launch(command: list[str], recipes: Path) -> subprocess.Popen:
    """``command`` (a spectrain.fit with ``trainer.devices=2``): Lightning starts the second process itself (it
    re-runs the command with LOCAL_RANK=1)."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        SPECTRAIN_RECIPES=str(recipes),
        DS_ACCELERATOR="cpu",
        PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")]),
    )
    return subprocess.Popen(
        [sys.executable, *command],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def finish(proc: subprocess.Popen, timeout: float = 900) -> None:
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err.decode()[-3000:]


def checkpoints(runs: Path) -> Path:
    (run,) = [p for p in runs.iterdir() if p.is_dir()]
    return run / "checkpoints"


def last_weights(runs: Path, name: str = "last.ckpt", step: int = STEPS) -> dict[str, torch.Tensor]:
    """The weights of checkpoint ``name`` (written at ``step``) of a run, whatever the strategy wrote: one file, a
    sharded (fsdp) or a DeepSpeed directory."""
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    from spectrain.checkpoint_reading import read_lightning_checkpoint

    path = checkpoints(runs) / name
    if path.is_dir() and (path / "latest").is_file():  # DeepSpeed's own partitioned layout
        full = runs / f"consolidated-{name}"
        if not full.exists():
            convert_zero_checkpoint_to_fp32_state_dict(str(path), str(full))
        path = full
    state = read_lightning_checkpoint(path)
    assert state["global_step"] == step
    return state["state_dict"]


def single_process_run(root: Path, kind: str) -> Path:
    """The 1-process run of ``kind`` with batch 2B (the reference of every multi-process run)."""
    runs = root / f"single_{kind}"
    if not runs.exists():
        cfg = fit_cli.compose_recipe(
            [*kind_args(root, kind), f"batch_size={2 * B}", "trainer.devices=1", f"runs_dir={runs}"],
            directory=root / "recipes",
        )
        assert fit_cli.fit(cfg)["global_step"] == STEPS
    return runs


@pytest.fixture(scope="module")
def trained(setup) -> None:
    """The one launch: everything in ``TRAINED``; eagle3 under DDP and specblock under FSDP (sharded, validating)
    with a checkpoint every 2 steps, and a run of each resumed from that step-2 checkpoint."""
    ddp_step2 = setup / "ddp_eagle3" / "eagle3_smollm2" / "checkpoints" / "step2.ckpt"
    fsdp_step2 = setup / "fsdp_sharded" / "specblock_smollm2" / "checkpoints" / "step2.ckpt"
    runs = [
        two_process_args(setup, kind, strategy, setup / f"{strategy}_{kind}", validate=(strategy, kind) in VALIDATED)
        for strategy, kinds in TRAINED.items()
        for kind in kinds
        if (strategy, kind) != ("ddp", "eagle3")
    ]
    runs += [
        two_process_args(setup, "eagle3", "ddp", setup / "ddp_eagle3", checkpoint_every=2),
        [*two_process_args(setup, "eagle3", "ddp", setup / "ddp_resumed"), f"resume={ddp_step2}"],
        two_process_args(setup, "specblock", "fsdp", setup / "fsdp_sharded", checkpoint_every=2, validate=True),
        [*two_process_args(setup, "specblock", "fsdp", setup / "fsdp_resumed", validate=True), f"resume={fsdp_step2}"],
    ]
    (setup / "runs.json").write_text(json.dumps([["spectrain.fit", args] for args in runs]))
    finish(launch([str(TESTS / "run_many.py"), str(setup / "runs.json")], setup / "recipes"))


def assert_trains_like_one_process(root: Path, runs: Path, kind: str) -> None:
    multi, single = last_weights(runs), last_weights(single_process_run(root, kind))
    assert multi.keys() == single.keys() and multi
    early = torch.load(checkpoints(root / f"single_{kind}") / "step2.ckpt", weights_only=False)["state_dict"]
    changed = 0
    for name, value in single.items():
        if name == "drafter.temperature":  # fitted after training by LBFGS on a 3-round validation NLL that is
            continue  # flat here (T runs off to ~1e6): its end point is not a function of the weights
        torch.testing.assert_close(multi[name], value, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")
        changed += not torch.equal(value, early[name])
    assert changed, "nothing trained"


@pytest.mark.parametrize("strategy, kind", [(s, k) for s, kinds in TRAINED.items() for k in kinds])
def test_two_processes_with_batch_b_train_like_one_process_with_batch_2b(setup, trained, strategy, kind):
    assert_trains_like_one_process(setup, setup / f"{strategy}_{kind}", kind)


def test_a_two_process_run_resumed_from_its_step_2_checkpoint_ends_on_the_uninterrupted_weights(setup, trained):
    assert not (checkpoints(setup / "ddp_resumed") / "step2.ckpt").exists()  # it started after step 2
    resumed, uninterrupted = last_weights(setup / "ddp_resumed"), last_weights(setup / "ddp_eagle3")
    assert resumed.keys() == uninterrupted.keys()
    for name, value in uninterrupted.items():
        assert torch.equal(resumed[name], value), name


def test_fsdp_on_two_processes_saves_sharded_resumes_and_exports_the_single_process_tensors(setup, trained, tmp_path):
    """trainer.strategy=fsdp (FSDP2 over gloo): every checkpoint is sharded; a run resumed from the step-2 one
    (resume=PATH) ends on the uninterrupted run's weights, and its export equals the export of 1 process with
    batch 2B."""
    full, resumed = checkpoints(setup / "fsdp_sharded"), checkpoints(setup / "fsdp_resumed")
    for ckpt in (full / "step2.ckpt", full / "last.ckpt", resumed / "last.ckpt"):
        assert export_cli.is_sharded_checkpoint(ckpt), ckpt  # one directory, a shard per process
    assert not (resumed / "step2.ckpt").exists()  # it started after step 2
    uninterrupted, again = last_weights(setup / "fsdp_sharded"), last_weights(setup / "fsdp_resumed")
    assert uninterrupted.keys() == again.keys() and uninterrupted
    for name, value in uninterrupted.items():
        assert torch.equal(again[name], value), name

    def exported(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
        assert export_cli.main([f"ckpt={ckpt}", "format=native", f"out={out}"]) == 0
        return load_file(out / "model.safetensors")

    sharded = exported(resumed / "last.ckpt", tmp_path / "fsdp_export")
    single = exported(checkpoints(single_process_run(setup, "specblock")) / "last.ckpt", tmp_path / "single_export")
    assert sharded.keys() == single.keys() and sharded
    for name, value in single.items():
        torch.testing.assert_close(sharded[name], value, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")
