"""``python -m spectrain.fit recipe=NAME key=value ...`` — train a drafter from a recipe.

Recipes are Hydra config-group options under ``recipes/recipe/``; the schema is ``spectrain.config.FitConfig``.
Overrides are checked before any work: an unknown key fails with one line naming it and the valid keys.
A key may be given by its full path (``trainer.max_steps=50``) or, when unambiguous, by its last part
(``max_steps=50``). The resolved recipe and the git commit are saved in ``runs/<run_name>/``.

Resume is exact: every checkpoint (``trainer.checkpoint_every_n_steps``, written atomically) holds the weights,
optimizer, scheduler, the train loader's position inside its epoch and the torch/numpy/python RNG states, so a run
killed at any point and restarted with ``resume=auto`` continues as if it had never stopped.
Modules named in ``SPECTRAIN_KIND_MODULES`` (comma-separated) are imported first, so drafter kinds defined outside
spectrain register themselves.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from core.assets import EMBEDDED_MODELS, AssetError, model_identity, resolve_model_dir
from core.distributed import reduce_across_processes
from core.overrides import RecipeError, bad_value, leaf_keys, resolve_key, run_cli, split_key_values
from data_prep.manifest import DatasetError, read_manifest
from inference.device import cpu_has_native_bf16
from spectrain.config import FitConfig
from spectrain.memory import MemoryEstimate, estimate, parameter_counts
from spectrain.recipe_checks import check_recipe_values
from spectrain.registry import get_kind
from spectrain.resume import checkpoint_layout, latest_checkpoint, resume_classes
from spectrain.strategies import build_strategy
from spectrain.targets import weightless_targets

REPO_ROOT = Path(__file__).resolve().parents[1]


def recipes_dir() -> Path:
    return Path(os.environ.get("SPECTRAIN_RECIPES", REPO_ROOT / "recipes")).resolve()


def available_recipes(directory: Path | None = None) -> list[str]:
    directory = directory or recipes_dir()
    return sorted(p.stem for p in (directory / "recipe").glob("*.yaml"))


def _split_overrides(argv: Sequence[str]) -> tuple[str | None, list[tuple[str, str]]]:
    pairs = split_key_values(argv, "python -m spectrain.fit recipe=NAME key=value ...")
    recipe = next((v for k, v in pairs if k == "recipe"), None)
    return recipe, [(k, v) for k, v in pairs if k != "recipe"]


def compose_recipe(argv: Sequence[str], directory: Path | None = None) -> DictConfig:
    """Compose and validate the recipe named in ``argv`` with its overrides; no side effects."""
    directory = (directory or recipes_dir()).resolve()
    recipe, pairs = _split_overrides(argv)
    names = available_recipes(directory)
    if recipe is None:
        raise RecipeError(f"no recipe given; usage: python -m spectrain.fit recipe=NAME; available: {', '.join(names)}")
    if recipe not in names:
        raise RecipeError(
            f"unknown recipe '{recipe}'; available: {', '.join(names) or '(none)'} (in {directory}/recipe)"
        )

    digest = _recipe_files_digest(directory)
    cfg = _composed(str(directory), recipe, digest)
    valid = leaf_keys(cfg, open_dicts=("model",))  # model fields are kind-specific
    # The kind's model fields the recipe leaves at their defaults are valid too; Hydra adds them with '+'.
    unset = [
        f"model.{k}"
        for k in _model_fields(dict(pairs).get("kind", OmegaConf.select(cfg, "kind")))
        if k not in cfg.model
    ]
    overrides = [
        ("+" if key in unset else "") + f"{key}={v}"
        for key, v in ((resolve_key(k, valid + unset), v) for k, v in pairs)
    ]
    # The overrides are applied to the composed recipe as Hydra's compose applies them (every override here names a
    # value, none a config group): a second composition would cost as much as the first.
    try:
        _apply_overrides(cfg, overrides)
    except Exception as exc:  # Hydra's messages are multi-line: name the override that fails, and why

        def alone(item: str) -> None:
            try:
                _apply_overrides(_composed(str(directory), recipe, digest), [item])
            except Exception as one:  # the reason is in the cause (e.g. omegaconf's conversion error)
                raise (one.__cause__ or one) from None

        raise RecipeError(f"bad override: {bad_value(overrides, exc, alone).removeprefix('bad value in ')}") from None
    OmegaConf.set_struct(cfg, True)
    _validate(cfg, recipe)
    return cfg


def _recipe_files_digest(directory: Path) -> str:
    """A digest of every recipe file's name and content: a recipe edited between two compositions is recomposed."""
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*.yaml")):
        digest.update(str(path.relative_to(directory)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _composed(directory: str, recipe: str, digest: str) -> DictConfig:
    """Recipe ``recipe`` of ``directory`` composed by Hydra without overrides, a copy the caller may change. A
    composition costs about a second (Hydra reads every option of the recipe group), so it is done once per process
    for each recipe and digest of the recipe files (a process training several runs composes each recipe once)."""
    return copy.deepcopy(_composed_once(directory, recipe, digest))


@functools.lru_cache(maxsize=32)
def _composed_once(directory: str, recipe: str, digest: str) -> DictConfig:
    from hydra import compose, initialize_config_dir  # Hydra: a heavy import, deferred to first use
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra

    ConfigStore.instance().store(name="fit_schema", node=FitConfig)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=directory, version_base="1.3"):
            return compose(config_name="config", overrides=[f"recipe={recipe}"])
    finally:
        GlobalHydra.instance().clear()


def _apply_overrides(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Apply value overrides (``key=value``, ``+key=value``) to a composed, struct-mode ``cfg`` in place, parsed by
    Hydra's grammar and merged as Hydra's own compose merges them after composing the defaults list."""
    from hydra.core.override_parser.overrides_parser import OverridesParser  # Hydra: deferred, as above

    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key = override.key_or_group
        try:
            value = override.value()
            if override.is_sweep_override():  # Hydra's compose refuses a sweep outside --multirun, so do we
                raise ValueError(
                    f"Ambiguous value for argument '{override.input_line}': to use it as a list, write "
                    "key=[value1,value2]; as a string, quote it"
                )
            if (
                override.is_add()
                and OmegaConf.select(cfg, key, throw_on_missing=False) is not None
                and not isinstance(value, (dict, list))
            ):
                raise ValueError(f"an item is already at '{key}'; remove the + prefix")
            OmegaConf.update(cfg, key, value, merge=True, force_add=override.is_add())
        except (OmegaConfBaseException, ValueError) as exc:  # the cause carries the reason; the caller names the key
            raise RecipeError(f"cannot merge override {override.input_line}") from exc


def _model_fields(kind_name: Any) -> list[str]:
    """The model fields kind ``kind_name`` accepts (none when the kind is unknown: validation says so later)."""
    try:
        schema = get_kind(str(kind_name)).model_schema
    except ValueError:
        return []
    return list(schema.__dataclass_fields__) if schema is not None else []


def _validate(cfg: DictConfig, recipe: str) -> None:
    missing = [k for k in ("kind", "run_name") if OmegaConf.is_missing(cfg, k)]
    if missing:
        raise RecipeError(f"recipe '{recipe}' does not set {', '.join(missing)}")
    check_recipe_values(cfg)
    try:
        kind = get_kind(cfg.kind)
    except ValueError as exc:
        raise RecipeError(str(exc)) from None
    if kind.model_schema is not None:
        schema = OmegaConf.structured(kind.model_schema)
        for key in cfg.model:
            if key not in schema:
                raise RecipeError(
                    f"unknown key 'model.{key}' for kind '{cfg.kind}'; valid: "
                    + ", ".join(f"model.{k}" for k in schema.keys())
                )
        try:
            merged = OmegaConf.merge(schema, cfg.model)  # type-checks values and fills defaults
        except Exception as exc:
            raise RecipeError(f"bad model field for kind '{cfg.kind}': {str(exc).splitlines()[0]}") from None
        with _unlocked(cfg):
            cfg.model = OmegaConf.to_container(merged)


class _unlocked:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg

    def __enter__(self):
        OmegaConf.set_struct(self.cfg, False)

    def __exit__(self, *exc):
        OmegaConf.set_struct(self.cfg, True)


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        commit = out.stdout.strip() or "unknown"
        return commit + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_dir(cfg: DictConfig) -> Path:
    return Path(cfg.runs_dir) / cfg.run_name


def resume_checkpoint(cfg: DictConfig) -> str | None:
    if cfg.resume == "never":
        return None
    if cfg.resume == "auto":
        found = latest_checkpoint(run_dir(cfg))
        return str(found) if found else None
    path = Path(cfg.resume)
    if not path.exists():  # a file, or the directory DeepSpeed writes under the .ckpt name
        raise RecipeError(f"resume={cfg.resume}: no such checkpoint; use resume=auto or a path to a .ckpt file")
    layout = checkpoint_layout(path)
    if layout is None:
        raise RecipeError(
            f"resume={cfg.resume} is not a checkpoint of python -m spectrain.fit (truncated, or another "
            "file or directory); give runs/<run>/checkpoints/last.ckpt (or stepN.ckpt), or resume=auto"
        )
    strategy = cfg.trainer.strategy
    wanted = {"sharded": "fsdp", "deepspeed": "deepspeed_stage_2 or deepspeed_stage_3"}.get(layout)
    if wanted and not (strategy == "fsdp" if layout == "sharded" else strategy.startswith("deepspeed")):
        raise RecipeError(
            f"resume={cfg.resume} is a {layout} checkpoint, which trainer.strategy={strategy} cannot "
            f"load; resume it with trainer.strategy={wanted}"
        )
    return str(path)


def build_logger(cfg: DictConfig, directory: Path):
    if cfg.logger == "csv":
        from lightning.pytorch.loggers import CSVLogger  # Lightning: a heavy import, deferred to first use

        return CSVLogger(save_dir=str(directory), name="logs")  # version_N per launch: a resume keeps old logs
    if cfg.logger == "tensorboard":
        # Lightning: a heavy import, deferred to first use
        from lightning.pytorch.loggers import TensorBoardLogger

        return TensorBoardLogger(save_dir=str(directory), name="tb")
    from lightning.pytorch.loggers import WandbLogger  # Lightning: a heavy import, deferred to first use

    # Without an API key wandb errors at once; offline mode keeps the run and syncs later.
    offline = os.environ.get("WANDB_MODE") == "offline" or not os.environ.get("WANDB_API_KEY")
    return WandbLogger(project=cfg.wandb_project, name=cfg.run_name, save_dir=str(directory), offline=offline)


def resolve_precision(precision: str, cuda: bool, cpu_bf16: bool | None = None) -> str:
    """The Lightning precision ``trainer.precision`` means on a machine with (``cuda``) or without CUDA.

    ``auto`` is bf16 autocast (``bf16-mixed``) on CUDA and fp32 on CPU. On a CPU, ``bf16-mixed`` is accepted only
    where the CPU computes bf16 natively (``cpu_bf16``, detected when None); elsewhere, and every other half
    precision on a CPU, is refused rather than silently emulated (slow)."""
    if precision == "auto":
        return "bf16-mixed" if cuda else "32-true"
    if cuda or precision == "32-true":
        return precision
    if precision == "bf16-mixed" and (cpu_has_native_bf16() if cpu_bf16 is None else cpu_bf16):
        return precision
    raise RecipeError(
        f"trainer.precision={precision} needs a CUDA GPU (bf16-mixed: or a CPU with native bf16, "
        "AVX512-BF16 or AMX) and none is used here; use precision=auto (fp32 on CPU) or "
        "precision=32-true"
    )


def _uses_cuda(cfg: DictConfig) -> bool:
    return cfg.trainer.accelerator in ("auto", "gpu", "cuda") and _cuda_available()


def build_trainer(cfg: DictConfig, directory: Path, extra_callbacks: Sequence[Any] = ()):
    import lightning.pytorch as pl  # Lightning: a heavy import, deferred to first use
    from lightning.pytorch.callbacks import ModelCheckpoint

    trainer_cfg = cfg.trainer
    precision = resolve_precision(trainer_cfg.precision, _uses_cuda(cfg))
    # DeepSpeed and FSDP write sharded checkpoint directories themselves (spectrain.strategies makes FSDP's
    # atomic); every other strategy goes through CheckpointIO.
    rng_callback, final_checkpoint, atomic_io = resume_classes()
    plugins = [] if trainer_cfg.strategy.startswith("deepspeed") or trainer_cfg.strategy == "fsdp" else [atomic_io()]
    checkpoints = [
        # No version counter: a resumed run overwrites last.ckpt instead of writing last-v1.ckpt beside it.
        ModelCheckpoint(
            dirpath=str(directory / "checkpoints"),
            filename="step{step}",
            auto_insert_metric_name=False,
            every_n_train_steps=trainer_cfg.checkpoint_every_n_steps,
            save_last=True,
            save_top_k=-1,
            enable_version_counter=False,
        ),
    ]
    if trainer_cfg.monitor:
        checkpoints.append(
            ModelCheckpoint(
                dirpath=str(directory / "checkpoints"),
                filename="best",
                monitor=trainer_cfg.monitor,
                mode=trainer_cfg.monitor_mode,
                save_top_k=1,
                auto_insert_metric_name=False,
                enable_version_counter=False,
            )
        )
    return pl.Trainer(
        default_root_dir=str(directory),
        max_steps=trainer_cfg.max_steps,
        val_check_interval=trainer_cfg.val_check_interval,
        check_val_every_n_epoch=None,
        limit_val_batches=trainer_cfg.limit_val_batches,
        accelerator=trainer_cfg.accelerator,
        devices=trainer_cfg.devices,
        num_nodes=trainer_cfg.num_nodes,
        strategy=build_strategy(trainer_cfg.strategy, _uses_cuda(cfg)),
        precision=precision,
        accumulate_grad_batches=trainer_cfg.accumulate_grad_batches,
        gradient_clip_val=trainer_cfg.gradient_clip_val or None,
        log_every_n_steps=trainer_cfg.log_every_n_steps,
        logger=build_logger(cfg, directory),
        callbacks=[
            *checkpoints,
            final_checkpoint(directory / "checkpoints" / "last.ckpt", trainer_cfg.checkpoint_every_n_steps),
            rng_callback(),
            *extra_callbacks,
        ],
        plugins=plugins,
        enable_progress_bar=True,
        # The loaders split each global batch across processes themselves (data_prep.rank_sampler), so that
        # N processes with batch b train on exactly the batches one process with batch N*b trains on.
        use_distributed_sampler=False,
    )


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def check_target(cfg: DictConfig) -> None:
    """Fail with one line, before any work, when ``target`` is neither a registry name nor a model directory."""
    if cfg.target in EMBEDDED_MODELS:
        return
    try:
        resolve_model_dir(cfg.target)
    except AssetError as exc:
        raise RecipeError(f"target={cfg.target} is not usable: {exc}; pass target=/path/to/model_dir") from None


def check_datasets(cfg: DictConfig) -> None:
    """Before any model loads: ``data.dataset_dir`` / ``data.val_dataset_dir`` must be spectrain datasets made
    for this target (the kind's DataModule checks the rest when it opens them)."""
    for key in ("dataset_dir", "val_dataset_dir"):
        directory = cfg.data.get(key)
        if not directory:
            continue
        try:
            manifest = read_manifest(directory)
        except DatasetError as exc:
            raise DatasetError(f"data.{key}={exc}") from None
        have, want = manifest.get("target") or {}, model_identity(str(cfg.target))
        if (have.get("config_hash"), have.get("weights_hash")) != (want["config_hash"], want["weights_hash"]):
            maker = "data_prep.traces" if manifest.get("kind") == "traces" else "data_prep.extract"
            raise DatasetError(
                f"data.{key}={directory} was made for target '{have.get('name')}' (config "
                f"{have.get('config_hash')}, weights {have.get('weights_hash')}), not "
                f"'{cfg.target}' (config {want['config_hash']}, weights {want['weights_hash']}): "
                f"re-create it with python -m {maker} target={cfg.target}, or train for the target "
                "it was made for"
            )


def import_kind_modules(names: str | None = None) -> None:
    """Import the out-of-tree drafter-kind modules named in ``SPECTRAIN_KIND_MODULES`` (comma-separated)."""
    names = os.environ.get("SPECTRAIN_KIND_MODULES", "") if names is None else names
    for name in filter(None, (n.strip() for n in names.split(","))):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise RecipeError(f"SPECTRAIN_KIND_MODULES names '{name}', which does not import: {exc}") from None


def save_run_info(cfg: DictConfig, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, directory / "recipe.yaml", resolve=True)
    info = {"git_commit": git_commit(), "argv": sys.argv[1:], "kind": cfg.kind}
    (directory / "run_info.json").write_text(json.dumps(info, indent=2))


def build_module_and_data(cfg: DictConfig) -> tuple[Any, Any]:
    """The kind's LightningModule and DataModule. A dry run builds them over a weightless (meta-device) target,
    so validating an 8B recipe reads no weights; a kind that copies target weights into its drafter cannot be
    built that way, and gets the real target instead (said in one line)."""
    kind = get_kind(cfg.kind)
    if cfg.dry_run:
        try:
            with weightless_targets():
                return kind.build_module(cfg), kind.build_datamodule(cfg)
        except (RuntimeError, NotImplementedError) as exc:  # what operations on meta tensors raise
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
            print(
                f"[spectrain] dry run: kind {cfg.kind} cannot be built without the target's weights ({reason}); "
                "loading them"
            )
    return kind.build_module(cfg), kind.build_datamodule(cfg)


def memory_estimate(cfg: DictConfig, module: Any, precision: str) -> MemoryEstimate:
    """``spectrain.memory.estimate`` for this recipe: devices x nodes, and the target only with online features."""
    devices = cfg.trainer.devices if isinstance(cfg.trainer.devices, int) and cfg.trainer.devices > 0 else 1
    online = not cfg.data.get("dataset_dir")
    target_params = 0
    if online and hasattr(module, "target_model"):
        with weightless_targets():  # its parameter count only: a meta-device copy, no weights read
            target_params = sum(p.numel() for p in module.target_model().parameters())
    trainable, frozen = parameter_counts(getattr(module, "drafter", module))
    return estimate(
        trainable,
        frozen,
        target_params,
        strategy=cfg.trainer.strategy,
        devices=devices * cfg.trainer.num_nodes,
        precision=precision,
    )


def fit(cfg: DictConfig) -> dict[str, Any]:
    """Train (or, with ``dry_run=true``, only build) the drafter a composed recipe describes."""
    import lightning.pytorch as pl  # Lightning: a heavy import, deferred to first use

    ckpt_path = resume_checkpoint(cfg)  # first: a named checkpoint that is not there must not fail on the data
    gpu_only = cfg.trainer.accelerator in ("gpu", "cuda") and not _cuda_available()
    if gpu_only and not cfg.dry_run:
        raise RecipeError(
            f"trainer.accelerator={cfg.trainer.accelerator} needs CUDA GPUs and none is visible; use "
            "trainer.accelerator=cpu (ddp, fsdp and deepspeed_stage_2/3 run on CPU over gloo), or "
            "dry_run=true to validate the recipe without GPUs"
        )
    check_target(cfg)
    if not cfg.dry_run:  # a dry run reads no data
        check_datasets(cfg)
    # Refuses half precision on CPU before any work (a GPU-only dry run checks what the GPUs will use).
    precision = resolve_precision(cfg.trainer.precision, cuda=gpu_only or _uses_cuda(cfg))
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    directory = run_dir(cfg)
    # The topmost directory this launch creates: removed again if it is refused before its first step.
    created = next((p for p in reversed([directory, *directory.parents]) if not p.exists()), None)
    module, datamodule = build_module_and_data(cfg)  # before the run directory: a bad model field writes nothing
    if not cfg.dry_run:  # idempotent (Lightning's own call then finds it done): data that does not fit the
        datamodule.setup("fit")  # recipe is refused before the Trainer prints or writes anything
    if cfg.dry_run:
        memory = memory_estimate(cfg, module, precision)
        print(f"[spectrain] dry run: {memory.line(cfg.trainer.strategy)}")
    if gpu_only:  # dry run without GPUs: Lightning refuses a CPU Trainer for a GPU recipe; build the strategy alone
        strategy = build_strategy(cfg.trainer.strategy, cuda=True)
        save_run_info(cfg, directory)
        print(
            f"[spectrain] dry run: built {type(module).__name__}, {type(datamodule).__name__} and "
            f"{type(strategy).__name__ if not isinstance(strategy, str) else strategy} (no GPU here, so no "
            f"Trainer; precision {precision} on the GPUs); nothing trained. Run dir: {directory}"
        )
        return {
            "run_dir": str(directory),
            "trained": False,
            "precision": precision,
            "strategy": strategy if isinstance(strategy, str) else type(strategy).__name__,
            "trainable_params": parameter_counts(module)[0],
            "memory_gib": memory.total_gib,
        }
    trainer = build_trainer(cfg, directory)
    save_run_info(cfg, directory)
    if cfg.dry_run:
        print(
            f"[spectrain] dry run: built {type(module).__name__}, {type(datamodule).__name__} and the trainer; "
            f"nothing trained. Run dir: {directory}"
        )
        return {
            "run_dir": str(directory),
            "trained": False,
            "strategy": type(trainer.strategy).__name__,
            "precision": trainer.precision,
            "trainable_params": parameter_counts(module)[0],
            "memory_gib": memory.total_gib,
        }
    if ckpt_path:
        print(f"[spectrain] resuming from {ckpt_path}")
    reduce_across_processes(True)  # loss denominators over the global batch when several processes train
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    except Exception:
        if created is not None and trainer.global_step == 0 and trainer.is_global_zero:
            shutil.rmtree(created, ignore_errors=True)  # refused before its first step (e.g. by the sampler)
        raise
    finally:
        reduce_across_processes(False)
    return {
        "run_dir": str(directory),
        "trained": True,
        "global_step": trainer.global_step,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Like every CLI (``core.overrides.run_cli``): a bad recipe, override, dataset or file is ONE line on
    stderr and exit code 2, wherever it is found (also inside the trainer, e.g. a DataModule's setup)."""

    def run(args: list[str]) -> dict[str, Any]:
        import_kind_modules()
        return fit(compose_recipe(args))

    return run_cli(argv, run, doc=f"{__doc__}\navailable recipes: {', '.join(available_recipes())}")


if __name__ == "__main__":
    sys.exit(main())
