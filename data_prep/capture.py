"""Run the target over token samples and cut out what a drafter trains on: the one feature computation.

Used by offline extraction (whose output is written to shards) and by the online DataModule (whose output goes
straight into a batch), so both produce the same tensors for the same batch of samples.

Per sample (``T`` = its token count, ``H`` = target hidden size, ``k`` = number of aux layers):
``input_ids [T]`` int64, ``loss_mask [T]`` int64, ``aux_hidden [T, k*H]`` (the aux layers concatenated in
increasing id order) and ``last_hidden [T, H]`` (after the final norm), both in the storage dtype. Logits are
not kept: the teacher distribution is ``lm_head(last_hidden)``, recomputed at training time.

``fp8`` (stored datasets only): both hidden tensors become float8_e4m3fn codes quantized from the runner's own
dtype, plus ``aux_hidden_scale [T, k]`` and ``last_hidden_scale [T, 1]`` (``data_prep.fp8``: one power-of-two
scale per token and layer).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from core.errors import UserError
from data_prep.fp8 import quantize
from data_prep.samples import TokenSample

STORAGE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
FP8 = "fp8"  # float8_e4m3fn codes plus per-token, per-layer scales: feature datasets only (data_prep.fp8)
FEATURE_DTYPES = (*STORAGE_DTYPES, FP8)


def storage_dtype(name: str) -> torch.dtype:
    if name not in STORAGE_DTYPES:
        raise UserError(f"dtype={name} is not a storage dtype; use one of {', '.join(STORAGE_DTYPES)}")
    return STORAGE_DTYPES[name]


def check_feature_dtype(name: str) -> str:
    """A feature dataset's storage dtype: the plain ones, or fp8."""
    if name not in FEATURE_DTYPES:
        raise UserError(f"dtype={name} is not a feature storage dtype; use one of {', '.join(FEATURE_DTYPES)}")
    return name


class HiddenCapture:
    """``capture(samples) -> [per-sample dict]``: one right-padded causal forward per call, no KV reuse.

    Right padding is exact under causal attention: a real token never attends to a later pad.
    """

    def __init__(self, runner, layers: Sequence[int], dtype: str = "bf16"):
        self.runner = runner
        self.layers = list(layers)
        self.fp8 = check_feature_dtype(dtype) == FP8
        self.dtype = None if self.fp8 else storage_dtype(dtype)

    @torch.no_grad()
    def __call__(self, samples: Sequence[TokenSample]) -> list[dict[str, torch.Tensor]]:
        runner = self.runner
        lengths = [len(s) for s in samples]
        width = max(lengths)
        if width > runner.max_seq_len:
            raise UserError(
                f"a sample has {width} tokens but the target runner holds {runner.max_seq_len}; lower max_len"
            )
        ids = torch.zeros(len(samples), width, dtype=torch.long)
        for row, sample in enumerate(samples):
            ids[row, : len(sample)] = torch.tensor(sample.input_ids)
        runner.reset(len(samples))  # a fresh, empty cache: a plain causal forward over the batch
        out = runner.forward(
            ids.to(runner.device), capture_layers=self.layers, return_last_hidden=True, only_last_logits=True
        )
        aux = torch.cat([out.hidden[i] for i in self.layers], dim=-1)
        last = out.last_hidden
        if not self.fp8:
            aux, last = aux.to(self.dtype), last.to(self.dtype)
        rows = []
        for row, (s, n) in enumerate(zip(samples, lengths)):
            sample = {
                "input_ids": torch.tensor(s.input_ids, dtype=torch.long),
                "loss_mask": torch.tensor(s.loss_mask, dtype=torch.long),
                "aux_hidden": aux[row, :n],
                "last_hidden": last[row, :n],
            }
            if self.fp8:  # from the runner's dtype: one rounding, e4m3's
                sample["aux_hidden"], sample["aux_hidden_scale"] = quantize(aux[row, :n], len(self.layers))
                sample["last_hidden"], sample["last_hidden_scale"] = quantize(last[row, :n], 1)
            rows.append(sample)
        return rows
