"""The values a training recipe may hold, checked before Lightning (or any model) sees them.

The schema (``spectrain.config``) gives each key its type; this gives each value its range or choices, so
``trainer.max_steps=-5`` or ``trainer.devices=0`` is one line naming the key and what it must be, not a Lightning
traceback after the target has loaded, and ``data.batch_size=0`` is refused by a dry run too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from core.overrides import RecipeError
from spectrain.config import ACCELERATORS, LOGGERS, MONITOR_MODES, PRECISIONS, SCHEDULERS, STRATEGIES


@dataclass(frozen=True)
class Rule:
    key: str  # dotted path in the recipe
    accepts: Callable[[Any], bool]
    requirement: str  # what an accepted value is, completing "KEY=VALUE must be ..."


def at_least(low: float) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= low


def one_of(choices: tuple[str, ...]) -> Callable[[Any], bool]:
    return lambda v: v in choices


def _devices(value: Any) -> bool:
    """What Lightning's ``devices`` means on every accelerator: auto, a count, -1 (all), or distinct device ids."""
    if value == "auto" or value == -1:
        return True
    if isinstance(value, int) and not isinstance(value, bool):
        return value >= 1
    if isinstance(value, (list, ListConfig)):
        ids = list(value)
        return (
            bool(ids)
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
            and len(set(ids)) == len(ids)
        )
    return False


def _betas(value: Any) -> bool:
    values = list(value) if isinstance(value, (list, ListConfig)) else []
    return len(values) == 2 and all(at_least(0.0)(b) and b < 1.0 for b in values)


RULES = (
    Rule("logger", one_of(LOGGERS), f"one of {', '.join(LOGGERS)}"),
    Rule("trainer.strategy", one_of(STRATEGIES), f"one of {', '.join(STRATEGIES)}"),
    Rule("trainer.precision", one_of(PRECISIONS), f"one of {', '.join(PRECISIONS)}"),
    Rule("trainer.accelerator", one_of(ACCELERATORS), f"one of {', '.join(ACCELERATORS)}"),
    Rule("trainer.devices", _devices, "auto, a count >= 1, -1 (every device) or a list of device ids such as [0,1]"),
    Rule("trainer.num_nodes", at_least(1), ">= 1"),
    Rule("trainer.max_steps", at_least(1), ">= 1 (the optimizer steps to train)"),
    Rule("trainer.val_check_interval", at_least(1), ">= 1 (training steps between validations)"),
    Rule(
        "trainer.limit_val_batches",
        lambda v: at_least(0.0)(v) and v <= 1.0,
        "between 0.0 and 1.0 (the fraction of validation batches run)",
    ),
    Rule("trainer.accumulate_grad_batches", at_least(1), ">= 1"),
    Rule("trainer.gradient_clip_val", at_least(0.0), ">= 0 (0 = no clipping)"),
    Rule("trainer.log_every_n_steps", at_least(1), ">= 1"),
    Rule("trainer.checkpoint_every_n_steps", at_least(1), ">= 1"),
    Rule("trainer.monitor_mode", one_of(MONITOR_MODES), f"one of {', '.join(MONITOR_MODES)}"),
    Rule("data.batch_size", at_least(1), ">= 1 (samples per process and step)"),
    Rule("data.n_samples", at_least(1), ">= 1"),
    Rule("data.n_val_samples", at_least(0), ">= 0"),
    Rule("data.max_len", at_least(2), ">= 2 (tokens per sample: a position and the token it predicts)"),
    Rule("data.num_workers", at_least(0), ">= 0"),
    Rule("optim.lr", lambda v: at_least(0.0)(v) and v > 0, "> 0"),
    Rule("optim.weight_decay", at_least(0.0), ">= 0"),
    Rule("optim.betas", _betas, "two numbers in [0, 1), such as [0.9,0.95]"),
    Rule("optim.warmup_steps", at_least(0), ">= 0"),
    Rule("optim.scheduler", one_of(SCHEDULERS), f"one of {', '.join(SCHEDULERS)}"),
)


def shown(value: Any) -> str:
    """A value as the user would write it on the command line."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)


def check_recipe_values(cfg: DictConfig) -> None:
    """Refuse, in one line (``RecipeError``), the first recipe value outside its range or choices."""
    for rule in RULES:
        value = OmegaConf.select(cfg, rule.key)
        if not rule.accepts(value):
            verb = "is not" if rule.requirement.startswith("one of") else "must be"
            raise RecipeError(f"{rule.key}={shown(value)} {verb} {rule.requirement}")
