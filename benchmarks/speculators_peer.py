"""``python -m benchmarks.speculators_peer [steps=40] [ttt_steps=7] [lr=1e-3] [n_train=40] [n_val=8] [max_len=128]``

Our EAGLE-3 training next to vLLM's ``speculators`` (0.9.0) on the embedded SmolLM2, same data, same seed.

First it tries the library's own trainer (``speculators.train.trainer.Trainer``) on this CPU and prints the error
it stops with. Then both training forwards run side by side for ``steps`` steps on identical batches (one
ShareGPT conversation per step, the target's own features): ours (``Eagle3Drafter`` + ``spectrain.kinds.eagle3.losses``)
and the library's ``Eagle3DraftModel.forward`` (its TTT loss), each with its own AdamW (same lr, no weight decay,
constant schedule), starting from the same weights (ours exported with ``format=speculators`` and loaded by the
library). Both freeze ``lm_head`` here, as speculators always does (it copies the target's head over the draft
vocabulary; our recipes train it). Prints per-step losses (ours is soft cross-entropy = KL + the teacher's
entropy, so it also prints ours minus that entropy) and, on held-out conversations, speculators' ``full_acc_j``
for both drafters, each computed by its own forward. The helpers are shared with
``tests/spectrain/test_speculators_interop.py``.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from speculators.losses import resolve_loss_config
from speculators.models import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.models.eagle3.data import shift_batch

from benchmarks.config import BenchConfig, Seeded, parse_bench
from core.assets import target_record
from core.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from core.drafters.eagle3.layouts import Eagle3Checkpoint
from core.prompts import load_prompts, tokenize_conversation
from core.vocab import build_vocab_map
from inference.algorithms.options import apply_threads
from inference.drafters import LoadedModel, load_lm
from spectrain.kinds.eagle3.export import write_export
from spectrain.kinds.eagle3.losses import scored_rows, teacher_in_draft_vocab, teacher_rows, ttt_loss

USAGE = "python -m benchmarks.speculators_peer steps=40 ttt_steps=7 lr=1e-3 n_train=40 n_val=8 max_len=128"
AUX = [1, 13, 26]  # EAGLE-3's default triple for SmolLM2's 30 layers, as data_prep uses it


@dataclass
class PeerConfig(BenchConfig, Seeded):
    steps: int = 40
    ttt_steps: int = 7
    decay: float = 0.8  # loss weight of TTT step j is decay ** j (speculators: ttt_step_loss_decay)
    lr: float = 1e-3
    n_train: int = 40
    n_val: int = 8
    max_len: int = 128
    draft_vocab_size: int = 4096


# ------------------------------------------------------------------------------------------------------------
# One batch through both forwards (also used by tests/spectrain/test_speculators_interop.py)


def features(target: LoadedModel, ids: torch.Tensor, aux: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's captured features [1, T, 3H] and the last decoder layer's output (pre-norm) [1, T, H]."""
    last = target.runner.num_layers - 1
    target.runner.reset(1)
    with torch.no_grad():
        out = target.runner.forward(ids, capture_layers=[*aux, last])
    return torch.cat([out.hidden[i] for i in aux], -1), out.hidden[last]


def our_steps(
    drafter: Eagle3Drafter,
    target: LoadedModel,
    ids: torch.Tensor,
    aux: torch.Tensor,
    pre_norm: torch.Tensor,
    supervised: torch.Tensor,
    steps: int,
):
    """Our training forward, as ``spectrain.kinds.eagle3.module`` runs it: per TTT step (student logits, teacher
    probs, scored rows)."""
    model = target.model
    normed = model.model.norm(pre_norm).detach()  # our datasets store the final normed state
    index, probs = teacher_rows(lambda h: model.lm_head(h).float(), normed, supervised, drafter.t2d)
    out = drafter(ids, aux, steps=steps, heads=False)
    result = []
    for j, hidden in enumerate(out.hidden):
        b, i, n = scored_rows(index, j)
        result.append((drafter.head(hidden[b, i]), probs[n], i))
    return result


def our_loss(steps, decay: float) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Σ_j decay^j soft-CE_j, the per-step losses, and Σ_j decay^j H(teacher_j) (soft-CE - KL)."""
    students, teachers, _ = zip(*steps)
    loss, per_step = ttt_loss(
        students, teachers, [torch.ones(len(s), dtype=torch.bool) for s in students], step_weight=decay
    )
    entropy = sum(decay**j * -(t * t.clamp_min(1e-30).log()).sum(-1).mean() for j, t in enumerate(teachers))
    return loss, per_step, entropy


def their_loss_mask(
    target: LoadedModel, pre_norm: torch.Tensor, supervised: torch.Tensor, t2d: torch.Tensor
) -> torch.Tensor:
    """speculators' ``loss_mask`` that scores exactly our rows: it reads ``loss_mask[p]`` as "the target's
    distribution at p is scored", we score p when token p+1 is supervised and the target's argmax is drafted."""
    with torch.no_grad():
        _, in_vocab = teacher_in_draft_vocab(target.model.lm_head(target.model.model.norm(pre_norm)), t2d)
    mask = torch.zeros_like(supervised)
    mask[:, :-1] = supervised[:, 1:] & in_vocab[:, :-1]
    return mask


def their_forward(
    theirs: Eagle3DraftModel,
    ids: torch.Tensor,
    aux: torch.Tensor,
    pre_norm: torch.Tensor,
    loss_mask: torch.Tensor,
    steps: int,
    decay: float,
):
    """The library's training forward on one sequence, shifted by its own ``shift_batch``: (drafted ids per step,
    loss, metrics)."""
    sample = {
        "input_ids": ids[0],
        "hidden_states": aux[0],
        "verifier_last_hidden_states": pre_norm[0],
        "loss_mask": loss_mask[0],
        "lengths": torch.tensor([ids.shape[1]]),
        "position_ids": torch.arange(ids.shape[1]),
    }
    batch = {k: v if k == "lengths" else v[None] for k, v in shift_batch(sample).items()}
    return theirs(
        batch["hidden_states"],
        batch["input_ids"],
        torch.zeros_like(batch["input_ids"]),
        loss_mask=batch["loss_mask"],
        position_ids=batch["position_ids"],
        verifier_last_hidden_states=batch["verifier_last_hidden_states"],
        ttt_steps=steps,
        ttt_step_loss_decay=decay,
        loss_config=resolve_loss_config("kl_div", "eager"),
    )


def load_theirs(directory: Path) -> Eagle3DraftModel:
    """The library's loader; eager attention because its default flex attention fails on short CPU inputs."""
    config = Eagle3SpeculatorConfig.from_pretrained(directory)
    config.transformer_layer_config._attn_implementation = "eager"
    return Eagle3DraftModel.from_pretrained(str(directory), config=config)


def full_accuracy(steps, length: int) -> list[float]:
    """speculators' ``full_acc_j`` from OUR per-row results: rows scored at step 0 and right at every step 0..j,
    over the rows step j scores (a row a step does not score counts as wrong there)."""
    right = torch.zeros(length, dtype=torch.bool)
    right[steps[0][2]] = True
    out = []
    for student, teacher, rows in steps:
        now = torch.zeros(length, dtype=torch.bool)
        now[rows] = student.argmax(-1) == teacher.argmax(-1)
        right &= now
        out.append(float(right[rows].sum()) / max(len(rows), 1))
    return out


# ------------------------------------------------------------------------------------------------------------
# The benchmark


def library_trainer_error(theirs: Eagle3DraftModel) -> str:
    """What the library's own trainer says when built on this CPU (the first line of its error)."""
    from speculators.train.trainer import Trainer, TrainerConfig  # speculators' trainer: only this probe uses it

    with tempfile.TemporaryDirectory() as tmp:
        try:
            Trainer(theirs, TrainerConfig(lr=1e-3, num_epochs=1, save_path=tmp, scheduler_type="none"), [])
        except Exception as exc:  # any failure is the measurement
            return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
    return "none: it builds on a CPU"


def conversations(target: LoadedModel, n: int, max_len: int, skip: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rows = []
    for conversation in load_prompts("sharegpt", n=skip + n)[skip:]:
        ids, mask = tokenize_conversation(target.tokenizer, conversation, max_len=max_len)
        if sum(mask) > 4:
            rows.append((torch.tensor([ids]), torch.tensor([mask], dtype=torch.bool)))
    return rows


def build_pair(cfg: PeerConfig, target: LoadedModel, train, out_dir: Path) -> tuple[Eagle3Drafter, Eagle3DraftModel]:
    """Our drafter (seeded) and the library's, loaded from our speculators export of it: the same weights."""
    model = target.model
    counts = np.bincount(torch.cat([ids[0] for ids, _ in train]).numpy(), minlength=model.config.vocab_size)
    d2t, t2d = build_vocab_map(counts, cfg.draft_vocab_size)
    torch.manual_seed(cfg.seed)
    config = Eagle3Config.for_target(model.config, draft_vocab_size=cfg.draft_vocab_size, aux_layer_ids=AUX)
    ours = Eagle3Drafter(config, embed_weight=model.model.embed_tokens.weight.detach())
    ours.set_vocab_map(d2t, t2d)
    with torch.no_grad():  # speculators' head: the target's, over the draft vocabulary, frozen
        ours.lm_head.weight.copy_(model.lm_head.weight[t2d])
    ours.lm_head.weight.requires_grad_(False)
    write_export(Eagle3Checkpoint.from_drafter(ours, target_record("smollm2")), out_dir, layout="speculators")
    return ours, load_theirs(out_dir).train()


def run(cfg: PeerConfig) -> None:
    target = load_lm("smollm2", max_seq_len=cfg.max_len + 8)
    train = conversations(target, cfg.n_train, cfg.max_len)
    val = conversations(target, cfg.n_val, cfg.max_len, skip=cfg.n_train)
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = build_pair(cfg, target, train, Path(tmp) / "speculators")
    print(f"speculators' own trainer on this CPU: {library_trainer_error(theirs)}")
    opt_ours = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    opt_theirs = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    print("| step | ours (soft-CE) | ours − H(teacher) | speculators (KL) | difference |\n|---|---|---|---|---|")
    for step in range(cfg.steps):
        ids, supervised = train[step % len(train)]
        aux, pre_norm = features(target, ids, AUX)
        loss, _, entropy = our_loss(our_steps(ours, target, ids, aux, pre_norm, supervised, cfg.ttt_steps), cfg.decay)
        mask = their_loss_mask(target, pre_norm, supervised, ours.t2d)
        _, their_loss, _ = their_forward(theirs, ids, aux, pre_norm, mask, cfg.ttt_steps, cfg.decay)
        for optimizer, value in ((opt_ours, loss), (opt_theirs, their_loss)):
            optimizer.zero_grad()
            value.backward()
            optimizer.step()
        if step % 5 == 0 or step == cfg.steps - 1:
            kl = float((loss - entropy).detach())
            print(
                f"| {step + 1} | {float(loss):.4f} | {kl:.4f} | {float(their_loss):.4f} | "
                f"{abs(kl - float(their_loss)):.1e} |"
            )
    report_validation(cfg, target, ours, theirs, val)


@torch.no_grad()
def report_validation(cfg: PeerConfig, target: LoadedModel, ours: Eagle3Drafter, theirs: Eagle3DraftModel, val) -> None:
    """speculators' full_acc_j on held-out conversations, for both drafters, each from its own forward."""
    mine, library, rows = np.zeros(cfg.ttt_steps), np.zeros(cfg.ttt_steps), np.zeros(cfg.ttt_steps)
    for ids, supervised in val:
        aux, pre_norm = features(target, ids, AUX)
        steps = our_steps(ours, target, ids, aux, pre_norm, supervised, cfg.ttt_steps)
        _, _, metrics = their_forward(
            theirs,
            ids,
            aux,
            pre_norm,
            their_loss_mask(target, pre_norm, supervised, ours.t2d),
            cfg.ttt_steps,
            cfg.decay,
        )
        for j, acc in enumerate(full_accuracy(steps, ids.shape[1])):
            mine[j] += acc * len(steps[j][2])
            library[j] += float(metrics[f"full_acc_{j}_sum"])
            rows[j] += len(steps[j][2])
    print("\nheld-out full_acc_j (rows right at every step 0..j), ours | speculators:")
    print(" ".join(f"{j}: {m / r:.3f} | {t / r:.3f}" for j, (m, t, r) in enumerate(zip(mine, library, rows))))


def parse_args(argv: Sequence[str]) -> Any:
    return parse_bench(argv, PeerConfig, USAGE)


def main(argv: list[str]) -> None:
    cfg = parse_args(argv)
    apply_threads(cfg)
    run(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
