"""Which target hidden states a dataset holds, and the one convention they are named in.

Every layer id in spectrain is an OUTPUT-of-decoder-layer index, 0-based: id ``i`` is the residual stream after
decoder layer ``i``, i.e. transformers' ``output_hidden_states[i + 1]`` (index 0 there is the embeddings).
``last_hidden`` is the state after the final norm, so ``lm_head(last_hidden) == logits``. This is the
inference runner's capture convention (``inference.runner_contract``), so features captured in training and at serving
time are the same tensors.

Layer specs (``layers=`` on the CLIs):

- ``eagle3``: the EAGLE-3 triple ``[1, L//2 - 1, L - 4]`` (SGLang/SpecForge/ModelOpt "output" ids; vLLM writes
  the same tensors as input ids ``[2, L//2, L - 3]``). SmolLM2 (L=30): ``[1, 14, 26]``.
- ``lastK`` (e.g. ``last4``, H-RAD): the last K entries of the HF ``hidden_states`` tuple, as SpecBranch's H-RAD
  reads them: raw outputs of layers ``L-K .. L-2`` plus the final-normed state. The aux ids are therefore
  ``[L-K, ..., L-2]`` and the K-th block is ``last_hidden`` (stored anyway), so nothing is stored twice.
- ``dflashK`` (e.g. ``dflash5``, DFlash): K ids spread from layer 1 to layer L - 3, as z-lab's
  ``build_target_layer_ids`` spreads them (Python's round, ties to even; K = 1: ``[L // 2]``). Qwen3-8B (L=36),
  K=5: ``[1, 9, 17, 25, 33]``; SmolLM2 (L=30): ``[1, 8, 14, 20, 27]``.
- ``[i, j, ...]``: explicit output-of-layer ids, increasing (negative ids count from the end).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from core.errors import UserError

LAYER_CONVENTION = (
    "output of decoder layer i, 0-based (transformers output_hidden_states[i + 1]); "
    "last_hidden is after the final norm (lm_head(last_hidden) == logits)"
)
_LAST_K = re.compile(r"^last(\d+)$")
_DFLASH_K = re.compile(r"^dflash(\d+)$")


def eagle3_layers(num_layers: int) -> list[int]:
    """The EAGLE-3 triple in output-of-layer ids: outputs of layers 1, L//2 - 1 and L - 4."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def dflash_layers(num_layers: int, count: int) -> list[int]:
    """z-lab's DFlash target layers: ``count`` output-of-layer ids from 1 to ``num_layers - 3``, evenly spread."""
    if count == 1:
        return [num_layers // 2]
    start, end = 1, num_layers - 3
    return [int(round(start + i * (end - start) / (count - 1))) for i in range(count)]


def resolve_layers(spec: Any, num_layers: int) -> list[int]:
    """Aux layer ids (output-of-layer, 0-based, increasing) for a spec: eagle3 | lastK | dflashK | [i, j, ...]."""
    if isinstance(spec, str) and spec == "eagle3":
        ids = eagle3_layers(num_layers)
        if len(set(ids)) < 3 or min(ids) < 0:
            raise UserError(
                f"layers=eagle3 gives {ids} for a {num_layers}-layer target (needs at least 8 "
                "layers); give explicit ids, e.g. layers=[0,1]"
            )
        return ids
    if isinstance(spec, str) and (match := _LAST_K.match(spec)):
        k = int(match.group(1))
        if not 2 <= k <= num_layers:
            raise UserError(f"layers={spec}: K must be in 2..{num_layers} for a {num_layers}-layer target")
        return list(range(num_layers - k, num_layers - 1))
    if isinstance(spec, str) and (match := _DFLASH_K.match(spec)):
        ids = dflash_layers(num_layers, int(match.group(1)))
        if int(match.group(1)) < 1 or len(set(ids)) < len(ids) or min(ids) < 0:
            raise UserError(
                f"layers={spec} gives {ids} for a {num_layers}-layer target: K must be in "
                f"1..{num_layers - 3}; or give explicit ids"
            )
        return ids
    if isinstance(spec, str) or not isinstance(spec, Sequence) or not spec:
        raise UserError(
            f"layers={spec!r} is not a layer spec; use eagle3, lastK (e.g. last4), dflashK (e.g. "
            "dflash5) or a list of output-of-layer ids like [1,14,26]"
        )
    ids = []
    for layer in spec:
        if isinstance(layer, bool) or not isinstance(layer, int) or not -num_layers <= layer < num_layers:
            raise UserError(
                f"layers={list(spec)}: {layer!r} is not a layer id of a {num_layers}-layer target "
                f"(0..{num_layers - 1}, negative counts from the end)"
            )
        ids.append(layer % num_layers)
    if any(a >= b for a, b in zip(ids, ids[1:])):
        # The order is the concatenation order of aux_hidden; never reorder silently.
        raise UserError(f"layers={list(spec)}: list distinct layer ids in increasing order")
    return ids


def spec_name(spec: Any) -> str:
    """A printable form of a layer spec for manifests (``eagle3``, ``last4``, ``[1, 2]``)."""
    return spec if isinstance(spec, str) else str([int(x) for x in spec])
