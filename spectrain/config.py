"""The structured schema of a training recipe.

Recipes (``recipes/recipe/*.yaml``) are data; this file says which keys exist, their types and defaults, so a
mistyped key fails before any work. Kind-specific model fields are validated by the schema each drafter kind
registers (``spectrain.registry``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class DataConfig:
    source: str = "sharegpt"  # a core.prompts source, or where the features were extracted from
    dataset_dir: str | None = None  # an extracted feature dataset (data_prep.extract); None = online
    val_source: str | None = None  # online: validation conversations from here (all of them, up to n_val_samples);
    #                                None = the eval split of source
    val_dataset_dir: str | None = None  # extracted validation features; online: the source's eval split
    layers: Any = "eagle3"  # target layers captured as features: eagle3 | lastK | [i, j, k]
    dtype: str = (
        "bf16"  # online feature dtype: bf16 | fp16 | fp32 (the rounding stored datasets use; fp8 is offline only)
    )
    n_val_samples: int = 16
    n_samples: int = 1000
    max_len: int = 512
    window: str = "start"  # online: start | answer, where a long conversation's window sits (data_prep.samples)
    bucket_by_length: bool = False  # online: batch samples of similar length (less padding; order stays seeded)
    chat_template: str = "auto"  # how conversations are rendered: auto (the tokenizer's) | none (text as is) | PATH
    batch_size: int = 8
    num_workers: int = 0


@dataclass
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 0
    scheduler: str = "cosine"  # cosine | constant


@dataclass
class TrainerConfig:
    max_steps: int = 1000
    val_check_interval: int = 100
    limit_val_batches: float = 1.0
    accelerator: str = "auto"
    devices: Any = "auto"
    num_nodes: int = 1
    strategy: str = "auto"  # auto | ddp | fsdp | deepspeed_stage_2 | deepspeed_stage_3
    precision: str = "auto"  # auto = bf16-mixed on CUDA, 32-true on CPU; half precision on CPU is refused
    accumulate_grad_batches: int = 1
    gradient_clip_val: float = 1.0
    log_every_n_steps: int = 10
    checkpoint_every_n_steps: int = 100  # each writes stepN.ckpt and last.ckpt (atomically); resume=auto uses last
    monitor: str = "val/tau_sim"
    monitor_mode: str = "max"


@dataclass
class FitConfig:
    kind: str = MISSING  # the drafter kind; dispatches to its LightningModule
    run_name: str = MISSING
    target: str = "smollm2"  # registry name or local HF model directory
    seed: int = 0
    logger: str = "csv"  # csv | wandb | tensorboard
    wandb_project: str = "spectrain"
    resume: str = "never"  # never | auto (latest checkpoint of this run name) | PATH to a .ckpt
    runs_dir: str = "runs"
    dry_run: bool = False  # build everything, train nothing
    model: dict[str, Any] = field(default_factory=dict)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


LOGGERS = ("csv", "wandb", "tensorboard")
STRATEGIES = ("auto", "ddp", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3")
PRECISIONS = ("auto", "32-true", "bf16-mixed", "bf16-true", "16-mixed")
ACCELERATORS = ("auto", "cpu", "gpu", "cuda")
SCHEDULERS = ("cosine", "constant")
MONITOR_MODES = ("min", "max")
