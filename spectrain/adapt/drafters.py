"""What the adapter needs from a drafter (:class:`AdaptableDrafter`) and the EAGLE-3 implementation.

A drafter plugs in with one small class: its head parameters (the output pathway: for EAGLE-3 the final norm and
``lm_head``; for SpecBlock ``lm_head`` + rank head), all trainable parameters (never the target's shared
embedding), the loss on one query's verified positions built from the TRAINING loss functions (no second copy),
and the two engine-side helpers that turn verification outputs into teacher rows and signal values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from core.drafters.eagle3 import Eagle3Drafter, shift_left
from core.errors import UserError
from spectrain.adapt.record import QueryRecord
from spectrain.adapt.signal import draft_prob_of
from spectrain.kinds.eagle3.losses import teacher_in_draft_vocab, ttt_loss, ttt_targets
from spectrain.metrics import SimulatedAcceptance, token_acceptance
from spectrain.kinds.specblock.losses import block_losses, rows_ahead, total_loss, unroll_blocks


@runtime_checkable
class AdaptableDrafter(Protocol):
    module: nn.Module

    def head_parameters(self) -> list[nn.Parameter]:
        """Output-pathway parameters the ``head`` arm updates (the decoder stays frozen)."""
        ...

    def all_parameters(self) -> list[nn.Parameter]:
        """Every parameter the ``full`` arm updates (never anything shared with the target)."""
        ...

    def loss_closure(self, record: QueryRecord, arm: str) -> Callable[[], torch.Tensor]:
        """A function returning the training loss on ``record``'s verified positions for ``arm`` (``head``:
        frozen parts may be computed once, before the closure is returned)."""
        ...

    def teacher_rows(self, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target logits [n, V] -> (teacher logits over the draft vocabulary [n, Vd], in-vocabulary mask [n])."""
        ...

    def draft_prob(self, draft_logits: torch.Tensor, target_token: int) -> float:
        """Drafter probability of a target token id from one row of draft logits (0 outside the draft vocab)."""
        ...

    def simulate(self, record: QueryRecord, gamma: int) -> tuple[float, list[float], int]:
        """Greedy chains of ``gamma`` drafts teacher-forced on ``record``: (τ_sim, q at each chain's first
        rejection, number of chains). Replay's environment and ``validate_on=tau``."""
        ...


def sharpened(teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Teacher logits at ``temperature`` (1: as recorded; 0: all mass on the argmax, the token a greedy verifier
    accepts). The losses soft-max them, so only the teacher's sharpness changes, never its argmax."""
    if temperature == 1.0:
        return teacher_logits
    if temperature == 0.0:
        hard = torch.full_like(teacher_logits, -1e4)
        return hard.scatter_(-1, teacher_logits.argmax(-1, keepdim=True), 0.0)
    return teacher_logits / temperature


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class FeatureDrafterAdaptable:
    """What EAGLE-3 and SpecBlock share: feature-conditioned, the target's embedding, a draft vocabulary with
    ``t2d`` / ``d2t``, and the EAGLE row convention (row t = token t and the target's features at t)."""

    def __init__(self, drafter, *, max_rows: int = 384, teacher_temperature: float = 1.0):
        if max_rows < 2:
            raise UserError(f"adapt.max_rows must be >= 2, got {max_rows}")
        if teacher_temperature < 0:
            raise UserError(
                f"adapt.teacher_temperature must be >= 0 (0: the target's greedy token), got {teacher_temperature}"
            )
        self.module, self.max_rows, self.teacher_temperature = drafter, max_rows, teacher_temperature
        self.lora = self._lora_parameters()  # adapters already on the module (a copy of one with them)
        # target id -> draft id (the drafted ids are the sorted members of t2d; data_prep.vocab's layout)
        self.draft_index = (torch.cumsum(drafter.t2d.long(), 0) - 1).clamp(min=0)

    def all_parameters(self) -> list[nn.Parameter]:
        shared = self.module.embed_tokens.weight  # the target's embedding: never trained here
        return [p for p in self.module.parameters() if p is not shared]

    def add_lora(self, rank: int) -> None:
        """Put peft LoRA adapters (rank ``rank``, zero-initialised B: the drafter's output is unchanged) on the
        decoder's linear layers, for the ``lora`` arm. Trainable flags stay as they were (peft would freeze the
        rest; the updater chooses per arm)."""
        from peft import LoraConfig, inject_adapter_in_model  # peft: a heavy import, deferred to first use

        if rank < 1:
            raise UserError(f"adapt.lora_rank must be >= 1, got {rank}")
        flags = {name: p.requires_grad for name, p in self.module.named_parameters()}
        config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS))
        inject_adapter_in_model(config, self.module)
        for name, p in self.module.named_parameters():
            base = name.replace(".base_layer.", ".")
            p.requires_grad_(flags.get(base, flags.get(name, True)))
        self.lora = self._lora_parameters()

    def _lora_parameters(self) -> list[nn.Parameter]:
        return [p for name, p in self.module.named_parameters() if ".lora_" in name]

    def lora_parameters(self) -> list[nn.Parameter]:
        lora = self.lora
        if not lora:
            raise ValueError("the lora arm needs LoRA adapters on the drafter: include lora in adapt.arms")
        return lora

    def teacher_rows(self, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return teacher_in_draft_vocab(target_logits.float(), self.module.t2d)

    def draft_prob(self, draft_logits: torch.Tensor, target_token: int) -> float:
        return draft_prob_of(draft_logits, target_token, self.draft_index, self.module.t2d)

    def batch(self, record: QueryRecord) -> dict[str, torch.Tensor]:
        """The record as one training sequence (the last ``max_rows`` rows; bounded update size)."""
        drafter = self.module
        device, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
        rows, prompt = record.num_rows, record.prompt_len
        start = max(0, rows - self.max_rows)
        vd = record.teacher.shape[-1]
        # teacher rows cover positions prompt-1 .. rows-1; the appended last token gets a zero row (never read)
        teacher = torch.zeros(rows + 1, vd)
        teacher[prompt - 1 : rows] = sharpened(record.teacher, self.teacher_temperature)
        in_vocab = torch.zeros(rows + 1, dtype=torch.bool)
        in_vocab[prompt - 1 : rows] = record.in_vocab
        supervised = torch.arange(rows + 1) >= prompt
        features = torch.cat([record.features, record.features.new_zeros(1, record.features.shape[1])])
        window = slice(start, rows + 1)
        return {
            "input_ids": record.tokens[window][None].to(device),
            "aux_hidden": features[window][None].to(device=device, dtype=dtype),
            "teacher": teacher[window][None].to(device),
            "in_vocab": in_vocab[window][None].to(device),
            "supervised": supervised[window][None].to(device),
        }

    def synthetic_record(self, rows: int, prompt_len: int, seed: int = 0) -> QueryRecord:
        """Random rows shaped like a real query (for timing the update arms only)."""
        config = self.module.config
        generator = torch.Generator().manual_seed(seed)
        prompt_len = max(1, min(prompt_len, rows - 1))
        teacher_rows = rows - prompt_len + 1
        return QueryRecord(
            prompt_len=prompt_len,
            tokens=torch.randint(config.vocab_size, (rows + 1,), generator=generator),
            features=torch.randn(rows, 3 * config.target_hidden_size, generator=generator),
            teacher=torch.randn(teacher_rows, config.draft_vocab_size, generator=generator),
            in_vocab=torch.ones(teacher_rows, dtype=torch.bool),
            accepted=[0],
            max_accept=2,
        )


class Eagle3Adaptable(FeatureDrafterAdaptable):
    """EAGLE-3: the loss is the training-time-test loss of ``spectrain.kinds.eagle3.module`` over the query's
    committed sequence (prompt rows as attention context only, generated rows supervised)."""

    def __init__(
        self,
        drafter,
        *,
        ttt_steps: int = 3,
        step_weight: float = 0.8,
        max_rows: int = 384,
        teacher_temperature: float = 1.0,
    ):
        if ttt_steps < 1:
            raise UserError(f"adapt.ttt_steps must be >= 1, got {ttt_steps}")
        super().__init__(drafter, max_rows=max_rows, teacher_temperature=teacher_temperature)
        self.ttt_steps, self.step_weight = ttt_steps, step_weight

    def head_parameters(self) -> list[nn.Parameter]:
        return [self.module.norm.weight, self.module.lm_head.weight]

    def loss_closure(self, record: QueryRecord, arm: str) -> Callable[[], torch.Tensor]:
        drafter, batch = self.module, self.batch(record)
        targets = ttt_targets(batch["teacher"], batch["in_vocab"], batch["supervised"], self.ttt_steps)
        teachers, masks = [t for t, _ in targets], [m for _, m in targets]

        def forward() -> list[torch.Tensor]:
            return drafter(batch["input_ids"], batch["aux_hidden"], steps=self.ttt_steps).logits

        if arm in ("full", "lora"):  # lora: the same loss, only the adapters are trainable (Updater)
            return lambda: ttt_loss(forward(), teachers, masks, step_weight=self.step_weight)[0]
        if arm == "head":
            with torch.no_grad():  # the frozen decoder runs once; steps reuse its hidden states (``head`` reads them)
                hidden = drafter(batch["input_ids"], batch["aux_hidden"], steps=self.ttt_steps).hidden
            # only supervised rows reach lm_head (same loss value: the loss is a mean over masked rows)
            hidden = [h[m] for h, m in zip(hidden, masks)]
            picked = [t[m] for t, m in zip(teachers, masks)]
            everywhere = [torch.ones(len(h), dtype=torch.bool, device=h.device) for h in hidden]

            def head_loss() -> torch.Tensor:
                students = [drafter.head(h) for h in hidden]
                return ttt_loss(students, picked, everywhere, step_weight=self.step_weight)[0]

            return head_loss
        raise ValueError(f"unknown update arm '{arm}'; use head, full or lora")

    @torch.no_grad()
    def simulate(self, record: QueryRecord, gamma: int) -> tuple[float, list[float], int]:
        """Replay's environment: greedy chains of ``gamma`` drafts from every generated row, teacher-forced on the
        recorded sequence. Returns (τ_sim, q_r at each chain's first rejection, number of chains)."""
        batch = self.batch(record)
        students = self.module(batch["input_ids"], batch["aux_hidden"], steps=gamma).logits
        targets = ttt_targets(batch["teacher"], batch["in_vocab"], batch["supervised"], gamma)
        alphas, valid, probs = [], [], []
        for k, (student, (teacher, _)) in enumerate(zip(students, targets)):
            # a target token outside the draft vocabulary is always rejected
            drafted = shift_left(batch["in_vocab"], k + 1, fill=False)
            alphas.append(token_acceptance(student, teacher, greedy=True) * drafted)
            valid.append(shift_left(batch["supervised"], k + 2, fill=False))
            q = student.float().softmax(-1).gather(-1, teacher.argmax(-1, keepdim=True))[..., 0]
            probs.append(q * drafted)
        metric = SimulatedAcceptance(gamma)
        metric.update(alphas, valid)
        starts = torch.stack(valid).all(0)
        alive = torch.ones_like(starts)
        rejection_q: list[float] = []
        for alpha, q in zip(alphas, probs):  # the first rejection of each valid chain
            rejected = alive & starts & (alpha == 0)
            rejection_q += q[rejected].tolist()
            alive = alive & (alpha > 0)
        return float(metric.compute()["tau_sim"]), rejection_q, int(starts.sum())


class SpecBlockAdaptable(FeatureDrafterAdaptable):
    """SpecBlock: docs/algorithms/specblock.md §5's loss, ``spectrain.kinds.specblock.losses`` (``unroll_blocks`` +
    ``total_loss``) over the query's committed sequence; ``head`` = lm_head + rank head (the drafter's
    ``head_parameters``): the trunk is frozen, so its graph is never built. Cuts between blocks are fixed
    (``block_size // 2``), so an update is deterministic."""

    def __init__(
        self,
        drafter,
        *,
        blocks: int = 2,
        slot_weight: float = 0.8,
        rank_weight: float = 1.0,
        max_rows: int = 384,
        teacher_temperature: float = 1.0,
    ):
        if blocks < 1:
            raise ValueError(f"SpecBlock adaptation needs blocks >= 1, got {blocks}")
        super().__init__(drafter, max_rows=max_rows, teacher_temperature=teacher_temperature)
        self.blocks, self.slot_weight, self.rank_weight = blocks, slot_weight, rank_weight

    def head_parameters(self) -> list[nn.Parameter]:
        return list(self.module.head_parameters())

    def _row_frame(self, record: QueryRecord):
        """The module's row frame (``SpecBlockModule._rows``): features, tokens x_{i+1}, teacher, position mask."""
        batch = self.batch(record)
        teacher = shift_left(batch["teacher"], 1).softmax(-1)
        pm = shift_left(batch["supervised"], 2, fill=False) & shift_left(batch["in_vocab"], 1, fill=False)
        return batch["aux_hidden"], shift_left(batch["input_ids"], 1), teacher, pm

    def loss_closure(self, record: QueryRecord, arm: str) -> Callable[[], torch.Tensor]:
        if arm not in ("head", "full", "lora"):
            raise ValueError(f"unknown update arm '{arm}'; use head, full or lora")
        aux, tokens, teacher, pm = self._row_frame(record)
        cuts = [max(1, self.module.config.block_size // 2)] * (self.blocks - 1)

        def loss() -> torch.Tensor:
            out = unroll_blocks(self.module, aux, tokens, teacher, pm, cuts)
            return total_loss(out, slot_weight=self.slot_weight, rank_weight=self.rank_weight)

        return loss

    @torch.no_grad()
    def simulate(self, record: QueryRecord, gamma: int) -> tuple[float, list[float], int]:
        """First-block chains (at most ``min(gamma, K)`` slots) from every anchor with a fully valid block."""
        aux, tokens, teacher, pm = self._row_frame(record)
        out = self.module.forward_block(aux, tokens, from_target=True)
        slots = min(gamma, self.module.config.block_size)
        losses = block_losses(out.logits, out.rank_logits, teacher, pm, 0)
        valid = losses.slot_valid[..., :slots].all(-1)
        correct = losses.correct[..., :slots].long()
        accepted = correct.cumprod(-1).sum(-1)  # leading greedy-correct slots
        rejection_q = []
        for k in range(slots):
            stopped = valid & (accepted == k)
            if stopped.any():
                target = rows_ahead(teacher, k).argmax(-1)
                q = out.logits[:, :, k].float().softmax(-1).gather(-1, target[..., None])[..., 0]
                rejection_q += q[stopped].tolist()
        starts = int(valid.sum())
        return 1.0 + float(accepted[valid].sum()) / max(starts, 1), rejection_q, starts


def adaptable_for(drafter, **settings) -> AdaptableDrafter:
    """The adapter class of a drafter module."""
    if isinstance(drafter, Eagle3Drafter):
        return Eagle3Adaptable(drafter, **settings)
    if hasattr(drafter, "forward_block") and hasattr(drafter, "head_parameters"):  # SpecBlockDrafter
        return SpecBlockAdaptable(
            drafter,
            max_rows=settings.get("max_rows", 384),
            teacher_temperature=settings.get("teacher_temperature", 1.0),
        )
    raise UserError(
        f"adapt=bandit does not support a {type(drafter).__name__} drafter; supported: Eagle3Drafter, SpecBlockDrafter"
    )
