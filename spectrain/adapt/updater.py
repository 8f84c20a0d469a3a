"""Bounded drafter updates with snapshot and restore.

An update is at most ``steps`` AdamW steps (fresh optimiser state: nothing carries over between updates, so a
rollback restores the exact pre-update drafter) at learning rate ``lr`` with the gradient norm clipped to
``clip``, on one query's record (or the mean loss over a few recent ones). Only the arm's parameters receive
gradients (others are frozen for the call).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from core.errors import UserError
from spectrain.adapt.drafters import AdaptableDrafter
from spectrain.adapt.record import QueryRecord


@dataclass
class ArmUpdate:
    steps: int
    lr: float


@dataclass
class UpdateResult:
    arm: str
    steps: int
    loss_before: float
    loss_after: float  # loss of the last step's forward (before its optimiser step)
    seconds: float


Snapshot = list[tuple[torch.nn.Parameter, torch.Tensor]]


class Updater:
    def __init__(self, adaptable: AdaptableDrafter, arms: dict[str, ArmUpdate], *, clip: float = 1.0):
        for arm, spec in arms.items():
            if spec.steps < 1 or spec.lr <= 0:
                raise UserError(f"adapt_{arm}_steps must be >= 1 and adapt_{arm}_lr > 0, got {spec.steps}, {spec.lr}")
        if clip <= 0:
            raise UserError(f"adapt.clip (gradient-norm bound) must be > 0, got {clip}")
        self.adaptable, self.arms, self.clip = adaptable, arms, clip

    def parameters(self, arm: str) -> list[torch.nn.Parameter]:
        if arm == "head":
            return self.adaptable.head_parameters()
        if arm == "full":
            return self.adaptable.all_parameters()
        if arm == "lora":
            return self.adaptable.lora_parameters()
        raise ValueError(f"unknown update arm '{arm}'; use head, full or lora")

    def snapshot(self) -> Snapshot:
        """Copies of every parameter any arm can change."""
        return [(p, p.detach().clone()) for p in self.adaptable.all_parameters()]

    @staticmethod
    def restore(snapshot: Snapshot) -> None:
        with torch.no_grad():
            for param, saved in snapshot:
                param.copy_(saved)

    def update(self, records: QueryRecord | Sequence[QueryRecord], arm: str) -> UpdateResult:
        """Train ``arm`` on ``records`` (one, or several: the mean of their losses, each its own sequence)."""
        records = [records] if isinstance(records, QueryRecord) else list(records)
        spec = self.arms[arm]
        params = self.parameters(arm)
        chosen = {id(p) for p in params}
        module = self.adaptable.module
        flags = [(p, p.requires_grad) for p in module.parameters()]
        start = time.perf_counter()
        losses: list[float] = []
        try:
            with torch.enable_grad():  # the engine generates under no_grad
                for p, _ in flags:
                    p.requires_grad_(id(p) in chosen)
                closures = [self.adaptable.loss_closure(record, arm) for record in records]

                def closure() -> torch.Tensor:
                    return torch.stack([c() for c in closures]).mean()

                optimizer = torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.0)
                for _ in range(spec.steps):
                    optimizer.zero_grad(set_to_none=True)
                    loss = closure()
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(params, self.clip)
                    optimizer.step()
                    losses.append(float(loss.detach()))
        finally:
            for p, flag in flags:
                p.requires_grad_(flag)
        return UpdateResult(arm, spec.steps, losses[0], losses[-1], time.perf_counter() - start)
