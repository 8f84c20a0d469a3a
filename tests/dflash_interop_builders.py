"""DFlash against speculators: a tiny target's features and the training-forward check."""

from __future__ import annotations

import pytest
import torch
from speculators.losses import resolve_loss_config
from speculators.models.dflash import DFlashDraftModel
from speculators.models.dflash.utils import select_anchors

from spectrain.kinds.dflash.losses import scored_slots, slot_weights, weighted_kl

LENGTH, ANCHORS, GAMMA = 40, 6, 4.0


def target_features(target, ids: torch.Tensor, aux: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(our features: the outputs of layers ``aux`` concatenated, the last decoder layer's output BEFORE the final
    norm: what the library's teacher reads) of an HF causal LM on ``ids``."""
    captured = []
    hook = target.model.layers[-1].register_forward_hook(
        lambda m, i, out: captured.append(out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
    hook.remove()
    return torch.cat([states[i + 1] for i in aux], -1), captured[0]


def check_training_forward_agrees(
    target,
    ours,
    theirs: DFlashDraftModel,
    ids: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    anchors: int,
    gamma: float = GAMMA,
    logit_tol: float = 1e-5,
    loss_rtol: float = 1e-5,
    grad_rtol: float = 1e-4,
    grad_atol: float = 1e-7,
    grad_atol_of_max: float = 0.0,
) -> dict:
    """On one batch ``ids`` [1, T] (``loss_mask`` its answer positions) and the anchors the library's own
    ``select_anchors`` draws: the library's training forward and ours give the same block logits, scored slots,
    loss (theirs divides by scored + 1e-5), per-slot argmax (every slot's, and its ``full_acc_sum``) and gradients of
    every trained tensor (to ``grad_rtol`` and ``grad_atol`` + ``grad_atol_of_max`` x its largest entry).
    ``theirs`` holds our drafter's weights and the target's final norm and head rows (its teacher); both drafters'
    gradients are accumulated here (zero them first). Returns the loss, the scored slots and how many of them
    draft the target's argmax."""
    block = ours.config.block_size
    features, pre_norm = target_features(target, ids, ours.config.aux_layer_ids)
    length = ids.shape[1]
    torch.manual_seed(0)
    _, their_logits, _, their_mask, _ = theirs._backbone_forward(
        features, ids, loss_mask, pre_norm, torch.zeros(1, length, dtype=torch.long), max_anchors=anchors
    )
    torch.manual_seed(0)
    _, their_loss, metrics = theirs(
        features,
        ids,
        loss_mask,
        pre_norm,
        torch.zeros(1, length, dtype=torch.long),
        loss_config=resolve_loss_config("kl_div", "eager"),
        gamma=gamma,
        max_anchors=anchors,
    )
    torch.manual_seed(0)
    drawn, valid = select_anchors(loss_mask, anchors, block)  # the same draw the library made
    our_logits = ours.head(ours(features, ids, drawn[None]))
    torch.testing.assert_close(our_logits.flatten(1, 2), their_logits, rtol=logit_tol, atol=logit_tol)
    assert torch.equal(our_logits.flatten(1, 2).argmax(-1), their_logits.argmax(-1))  # every slot drafts the same

    # the scored slots: the library's aligned mask without the anchor slot
    b, a, k, positions = scored_slots(drawn[None], valid[None], loss_mask.bool(), block)
    theirs_scored = their_mask[0].view(anchors, block).nonzero().tolist()
    assert len(k) > 0 and sorted(zip(a.tolist(), k.tolist())) == sorted(map(tuple, theirs_scored))
    with torch.no_grad():  # ours: the normed final state (what our datasets store) through the head's rows
        teacher = (target.model.norm(pre_norm) @ ours.lm_head.weight.T)[0, positions - 1].softmax(-1)
    student = our_logits[b, a, k]
    loss = weighted_kl(student, teacher, slot_weights(block, gamma)[k]) * len(k) / (len(k) + 1e-5)
    assert float(loss.detach()) == pytest.approx(float(their_loss.detach()), rel=loss_rtol)
    right = student.argmax(-1) == teacher.argmax(-1)
    assert right.sum() == metrics["full_acc_sum"]
    loss.backward()
    their_loss.backward()
    theirs_params = dict(theirs.named_parameters())
    trained = [(name, p) for name, p in ours.named_parameters() if p.requires_grad]
    assert len(trained) > 10
    for name, param in trained:
        assert param.grad is not None and theirs_params[name].grad is not None, name
        atol = grad_atol + grad_atol_of_max * float(theirs_params[name].grad.abs().max())
        torch.testing.assert_close(param.grad, theirs_params[name].grad, rtol=grad_rtol, atol=atol, msg=name)
    return {"loss": float(loss.detach()), "scored": len(k), "right": int(right.sum())}
