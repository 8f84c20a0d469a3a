"""The recipe CLI: composition, one-line errors, run directory, resume=auto, strategies built by a dry run,
precision mapping, and the GPU recipe eagle3_llama8b validated on CPU. (Exact resume: test_resume.py.)"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fit_recipes import TOY_RECIPE, ToyData  # importing it registers the kind toy_regression
from omegaconf import OmegaConf
from tiny_targets import save_tiny_target, write_jsonl

from core.overrides import OverrideError, resolve_key
from spectrain import fit as fit_cli

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def recipes(tmp_path: Path) -> Path:
    directory = tmp_path / "recipes"
    (directory / "recipe").mkdir(parents=True)
    shutil.copy(REPO / "recipes" / "config.yaml", directory / "config.yaml")
    (directory / "recipe" / "toy.yaml").write_text(TOY_RECIPE)
    return directory


def compose(recipes: Path, *args: str):
    return fit_cli.compose_recipe(list(args), directory=recipes)


def test_compose_applies_overrides_by_path_and_by_unique_leaf(recipes, tmp_path):
    cfg = compose(recipes, "recipe=toy", "trainer.max_steps=3", "lr=0.5", "model.hidden=4", f"runs_dir={tmp_path}")
    assert cfg.trainer.max_steps == 3 and cfg.optim.lr == 0.5 and cfg.model.hidden == 4
    assert cfg.kind == "toy_regression" and cfg.data.batch_size == 16


@pytest.mark.parametrize(
    "args, needle",
    [
        (("recipe=toy", "max_stepz=3"), "unknown key 'max_stepz' (did you mean 'max_steps'?); valid keys:"),
        (("recipe=toy", "model.width=3"), "unknown key 'model.width'"),
        (("recipe=nope",), "unknown recipe 'nope'; available: toy"),
        (("max_steps=1",), "no recipe given"),
        (("recipe=toy", "logger=neptune"), "logger=neptune is not one of csv, wandb, tensorboard"),
        (("recipe=toy", "strategy=horovod"), "trainer.strategy=horovod is not one of"),
        (("recipe=toy", "kind=nope"), "unknown kind 'nope'"),
        (("recipe=toy", "trainer.max_steps=abc"), "bad override"),
        (("recipe=toy", "oops"), "is not key=value"),
    ],
)
def test_bad_input_fails_with_one_line(recipes, args, needle):
    with pytest.raises(OverrideError) as info:
        compose(recipes, *args)
    message = str(info.value)
    assert needle in message and "\n" not in message


def test_ambiguous_leaf_key_is_refused(recipes):
    # both data.* and trainer.* would need a qualified name if a leaf repeats; 'lr' is unique, 'hidden' too,
    # so build an ambiguity through the model dict: model.max_steps vs trainer.max_steps.
    with pytest.raises(OverrideError, match="ambiguous"):
        resolve_key("max_steps", ["trainer.max_steps", "model.max_steps"])


def test_fit_saves_run_info_and_resume_auto_continues(recipes, tmp_path):
    runs = tmp_path / "runs"
    cfg = compose(recipes, "recipe=toy", f"runs_dir={runs}")
    result = fit_cli.fit(cfg)
    assert result["trained"] and result["global_step"] == 6
    saved = OmegaConf.load(runs / "toy" / "recipe.yaml")
    assert saved.kind == "toy_regression" and saved.trainer.max_steps == 6
    info = json.loads((runs / "toy" / "run_info.json").read_text())
    assert info["git_commit"]
    assert (runs / "toy" / "checkpoints" / "last.ckpt").is_file()
    assert list((runs / "toy" / "logs").glob("version_*/metrics.csv"))

    resumed = fit_cli.fit(compose(recipes, "recipe=toy", f"runs_dir={runs}", "resume=auto", "max_steps=10"))
    assert resumed["global_step"] == 10
    state = torch.load(runs / "toy" / "checkpoints" / "last.ckpt", weights_only=False)
    assert state["global_step"] == 10


def test_resume_path_must_exist(recipes, tmp_path):
    cfg = compose(recipes, "recipe=toy", f"runs_dir={tmp_path}", "resume=/no/such.ckpt")
    with pytest.raises(fit_cli.RecipeError, match="no such checkpoint"):
        fit_cli.fit(cfg)


def test_a_resume_checkpoint_is_checked_before_anything_else(recipes, tmp_path):
    (tmp_path / "notes.ckpt").write_text("not a checkpoint\n")
    sharded = tmp_path / "sharded.ckpt"  # what trainer.strategy=fsdp writes: a directory
    sharded.mkdir()
    (sharded / ".metadata").write_bytes(b"")
    (sharded / "meta.pt").write_bytes(b"")
    for resume_from, message in [
        (
            "notes.ckpt",
            "resume={p} is not a checkpoint of python -m spectrain.fit (truncated, or another file or "
            "directory); give runs/<run>/checkpoints/last.ckpt (or stepN.ckpt), or resume=auto",
        ),
        (
            "sharded.ckpt",
            "resume={p} is a sharded checkpoint, which trainer.strategy=auto cannot load; resume it "
            "with trainer.strategy=fsdp",
        ),
    ]:
        path = tmp_path / resume_from
        with pytest.raises(fit_cli.RecipeError) as info:  # a target that does not exist is never looked at
            fit_cli.fit(
                compose(
                    recipes,
                    "recipe=toy",
                    f"runs_dir={tmp_path / 'runs'}",
                    f"resume={path}",
                    f"target={tmp_path / 'nowhere'}",
                )
            )
        assert str(info.value) == message.format(p=path)
    assert not (tmp_path / "runs").exists()


def test_a_run_refused_before_its_first_step_leaves_no_run_directory(recipes, tmp_path, monkeypatch):
    def too_few_samples(self):  # as RankSlicedSampler refuses inside Lightning, once processes exist
        raise ValueError("2 training samples do not fill one global batch")

    monkeypatch.setattr(ToyData, "train_dataloader", too_few_samples)
    with pytest.raises(ValueError, match="do not fill one global batch"):
        fit_cli.fit(compose(recipes, "recipe=toy", f"runs_dir={tmp_path / 'runs'}"))
    assert not (tmp_path / "runs").exists()


def test_dry_run_builds_without_training(recipes, tmp_path):
    result = fit_cli.fit(compose(recipes, "recipe=toy", f"runs_dir={tmp_path}", "dry_run=true", "logger=tensorboard"))
    params = 4 * 8 + 8 + 8 + 1
    assert result == {
        "run_dir": str(tmp_path / "toy"),
        "trained": False,
        "strategy": "SingleDeviceStrategy",
        "precision": "32-true",
        "trainable_params": params,
        "memory_gib": 16 * params / 2**30,
    }  # fp32 AdamW: weight, gradient, two moments
    assert not (tmp_path / "toy" / "checkpoints").exists()


def test_cli_unknown_recipe_exits_2_with_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "spectrain.fit", "recipe=definitely_not_a_recipe"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: unknown recipe 'definitely_not_a_recipe'")


def test_wandb_logger_is_offline_without_an_api_key(recipes, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = compose(recipes, "recipe=toy", f"runs_dir={tmp_path}", "logger=wandb")
    logger = fit_cli.build_logger(cfg, tmp_path / "toy")
    assert type(logger).__name__ == "WandbLogger" and logger._offline


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_fsdp_and_ddp_build_their_cpu_strategies_by_a_dry_run(recipes, tmp_path):
    # Multi-process runs of these strategies: tests/spectrain/test_distributed_training.py.
    built = {
        name: fit_cli.fit(compose(recipes, "recipe=toy", f"runs_dir={tmp_path}", f"strategy={name}", "dry_run=true"))[
            "strategy"
        ]
        for name in ("fsdp", "ddp")
    }
    assert built == {"fsdp": "ShardedDataParallel", "ddp": "DDPStrategy"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_a_gpu_accelerator_without_cuda_is_refused_in_one_line_unless_dry_run(recipes, tmp_path):
    with pytest.raises(fit_cli.RecipeError) as info:
        fit_cli.fit(compose(recipes, "recipe=toy", f"runs_dir={tmp_path}", "accelerator=gpu"))
    assert str(info.value) == (
        "trainer.accelerator=gpu needs CUDA GPUs and none is visible; use "
        "trainer.accelerator=cpu (ddp, fsdp and deepspeed_stage_2/3 run on CPU over gloo), "
        "or dry_run=true to validate the recipe without GPUs"
    )
    result = fit_cli.fit(
        compose(recipes, "recipe=toy", f"runs_dir={tmp_path}", "accelerator=gpu", "dry_run=true", "strategy=fsdp")
    )
    assert result["strategy"] == "ShardedDataParallel" and result["precision"] == "bf16-mixed"


@pytest.mark.parametrize(
    "precision, cuda, expected",
    [
        ("auto", True, "bf16-mixed"),
        ("auto", False, "32-true"),
        ("bf16-mixed", True, "bf16-mixed"),
        ("32-true", False, "32-true"),
        ("32-true", True, "32-true"),
        ("16-mixed", True, "16-mixed"),
    ],
)
def test_precision_maps_to_bf16_autocast_on_cuda_and_fp32_on_cpu(precision, cuda, expected):
    assert fit_cli.resolve_precision(precision, cuda) == expected


@pytest.mark.parametrize(
    "precision, cpu_bf16, accepted",
    [
        ("bf16-mixed", True, True),
        ("bf16-mixed", False, False),
        ("bf16-true", True, False),
        ("16-mixed", True, False),
    ],
)
def test_on_cpu_only_bf16_autocast_on_a_native_bf16_cpu_is_accepted(precision, cpu_bf16, accepted):
    if accepted:
        assert fit_cli.resolve_precision(precision, cuda=False, cpu_bf16=cpu_bf16) == precision
    else:
        with pytest.raises(fit_cli.RecipeError, match=f"trainer.precision={precision} needs a CUDA GPU"):
            fit_cli.resolve_precision(precision, cuda=False, cpu_bf16=cpu_bf16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_half_precision_on_cpu_is_refused_before_any_work(recipes, tmp_path, monkeypatch):
    monkeypatch.setattr(fit_cli, "cpu_has_native_bf16", lambda: False)  # a CPU without native bf16
    with pytest.raises(fit_cli.RecipeError) as info:
        fit_cli.fit(compose(recipes, "recipe=toy", f"runs_dir={tmp_path}", "precision=bf16-mixed"))
    assert str(info.value) == (
        "trainer.precision=bf16-mixed needs a CUDA GPU (bf16-mixed: or a CPU with native "
        "bf16, AVX512-BF16 or AMX) and none is used here; use precision=auto (fp32 on CPU) "
        "or precision=32-true"
    )
    assert not (tmp_path / "toy").exists()
    with pytest.raises(fit_cli.RecipeError, match="trainer.precision=fp8 is not one of auto, 32-true, bf16-mixed"):
        compose(recipes, "recipe=toy", "precision=fp8")


needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (make install adds the [deepspeed] extra)",
)


@needs_deepspeed
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_strategies_are_built_by_a_dry_run(recipes, tmp_path, stage):
    strategy = f"deepspeed_stage_{stage}"
    result = fit_cli.fit(compose(recipes, "recipe=toy", f"runs_dir={tmp_path}", f"strategy={strategy}", "dry_run=true"))
    assert result["strategy"] == "CPUDeepSpeed" and not result["trained"]
    assert fit_cli.build_strategy(strategy, cuda=False).config["zero_optimization"]["stage"] == stage
    assert fit_cli.build_strategy(strategy, cuda=True).config["zero_optimization"]["stage"] == stage


@needs_deepspeed
def test_deepspeed_training_skips_the_shm_all_reduce_build():
    """The CPU backend's shared-memory op (minutes of JIT compile on a fresh host) is never built for training:
    DeepSpeed's own builder then returns nothing, and its inference all-reduce falls back to torch.distributed."""
    import importlib

    import deepspeed.ops

    from spectrain.strategies import SHM_COMM_OP, skip_shm_comm_build

    skip_shm_comm_build()
    assert deepspeed.ops.__compatible_ops__[SHM_COMM_OP] is False
    assert importlib.import_module("deepspeed.comm.torch").build_shm_op() is None


@pytest.fixture()
def llama8b_args(tmp_path: Path) -> list[str]:
    """The real eagle3_llama8b recipe with a tiny local HF directory as the 8B target and a small prompt file."""
    target = save_tiny_target(tmp_path / "Llama-3.1-8B-Instruct", layers=8, hidden=32)  # eagle3 layers need >= 8
    source = write_jsonl(tmp_path / "chats.jsonl", 12)
    return [
        "recipe=eagle3_llama8b",
        f"target={target}",
        f"source=jsonl:{source}",
        "n_samples=12",
        "draft_vocab_size=256",
        f"runs_dir={tmp_path / 'runs'}",
    ]


@needs_deepspeed
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_eagle3_llama8b_recipe_dry_runs_on_cpu_without_the_weights(llama8b_args, monkeypatch):
    from spectrain import targets

    cfg = fit_cli.compose_recipe([*llama8b_args, "dry_run=true"])
    assert (cfg.kind, cfg.trainer.strategy, cfg.trainer.precision, cfg.trainer.devices, cfg.logger) == (
        "eagle3",
        "deepspeed_stage_2",
        "bf16-mixed",
        8,
        "wandb",
    )
    monkeypatch.setattr(targets, "_loaded_target", None)  # reading the target's weights would fail the dry run
    result = fit_cli.fit(cfg)
    assert result["strategy"] == "DeepSpeedStrategy" and result["precision"] == "bf16-mixed"
    assert not result["trained"] and result["trainable_params"] > 0
    assert fit_cli.OmegaConf.load(Path(result["run_dir"]) / "recipe.yaml").target == cfg.target


def test_eagle3_llama8b_recipe_without_its_target_fails_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SPECTRAIN_LLAMA8B", raising=False)
    monkeypatch.chdir(tmp_path)
    assert fit_cli.main(["recipe=eagle3_llama8b", "dry_run=true", f"runs_dir={tmp_path}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: target=models/Llama-3.1-8B-Instruct is not usable: unknown model 'models/Llama-3.1-8B-Instruct'"
    )
    assert "pass target=/path/to/model_dir" in lines[0]
