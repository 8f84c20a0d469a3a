"""``python -m benchmarks.moe_rows [rows=[1,2,4,8,16,64]] [context=256] [paths=[exact,plain]] [routing=random]
[threads=1] [repeats=7] [out=DIR]``

What verifying T rows costs on a mixture-of-experts target, against a dense target of the same active parameters:
milliseconds of one native-runner forward of T new tokens over ``context`` cached tokens (fp32, median of
``repeats``, the two targets timed in turn so that a change in the machine's load hits both alike), and per sparse
layer how many distinct experts the T tokens route to. A dense forward streams the same weights for 1 or 16 rows;
an MoE forward streams every expert its rows touch, so its cost can grow with T where the dense one stays flat, and
speculation pays only while the accepted tokens per step exceed ``t(T) / t(1)`` (the ``break-even τ`` column,
drafter cost left out).

The targets are Qwen3-MoE and Qwen3 configs built by transformers (random weights, nothing downloaded): equal
attention, embeddings and head; the dense MLP is as wide as the ``top_k`` experts a token uses together.
``routing=random`` keeps transformers' random routers, which send most tokens to the same few experts (a random
model's hidden states share a large common component); ``routing=spread`` makes each router ignore that component
(``spread_routers``), so tokens spread over the experts about as uniformly as a load-balanced trained router spreads
a batch (E·(1 − (1 − k/E)^T) distinct experts expected for T independent tokens).
``paths``: ``exact`` (the runner's exact mode, ``docs/numerics.md``) and ``plain`` (``exact=false``).
Writes ``results.json`` to ``out`` when given and prints a table.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from benchmarks.config import BenchConfig, Output, Repeats, parse_bench
from core.overrides import run_cli
from inference.algorithms.options import apply_threads
from inference.llama import SparseMoe
from inference.runner import ModelRunner

USAGE = (
    "python -m benchmarks.moe_rows rows=[1,2,4,8,16,64] context=256 paths=[exact,plain] routing=random|spread "
    "threads=1 repeats=7 out=DIR"
)


@dataclass
class MoeRowsConfig(BenchConfig, Output, Repeats):
    """``out``: a directory for results.json (optional)."""

    rows: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 64])
    context: int = 256
    paths: list[str] = field(default_factory=lambda: ["exact", "plain"])
    hidden: int = 512
    layers: int = 6
    heads: int = 8
    kv_heads: int = 4
    experts: int = 64
    top_k: int = 8
    expert_width: int = 192
    vocab: int = 8192
    routing: str = "random"  # random | spread (spread_routers)


def targets(cfg: MoeRowsConfig) -> dict[str, torch.nn.Module]:
    """name -> a random transformers model: the MoE target and the dense one of the same active parameters."""
    shared = dict(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.hidden // cfg.heads,
        intermediate_size=cfg.top_k * cfg.expert_width,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    moe = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            **shared,
            moe_intermediate_size=cfg.expert_width,
            num_experts=cfg.experts,
            num_experts_per_tok=cfg.top_k,
            norm_topk_prob=True,
        )
    ).eval()
    dense = Qwen3ForCausalLM(Qwen3Config(**shared)).eval()
    return {"moe": moe, "dense": dense}


@torch.no_grad()
def spread_routers(model: torch.nn.Module, ids: torch.Tensor, scale: float = 20.0) -> None:
    """Make each router spread tokens over its experts: a random model's hidden states share a large common
    component (attention over random keys averages the values), so its routers send most tokens to the same few
    experts. Each router's rows are made orthogonal to the mean hidden state reaching it over ``ids`` and scaled up,
    so that the experts a token takes follow what is its own."""
    means = {}

    def record(index: int):
        def hook(_module, args):
            means[index] = args[0].reshape(-1, args[0].shape[-1]).mean(0)

        return hook

    sparse = [(i, layer.mlp) for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    hooks = [mlp.register_forward_pre_hook(record(i)) for i, mlp in sparse]
    try:
        model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    for i, mlp in sparse:
        direction = means[i] / means[i].norm()
        weight = mlp.gate.weight
        weight.sub_((weight @ direction)[:, None] * direction[None]).mul_(scale)


def active_parameters(runner: ModelRunner, top_k: int) -> int:
    """Parameters one token's forward reads: all but the experts it is not routed to."""
    total = sum(p.numel() for p in runner.parameters())
    for layer in runner.model.layers:
        if isinstance(layer.mlp, SparseMoe):
            experts = layer.mlp.experts
            per_expert = (experts.gate_up_proj.numel() + experts.down_proj.numel()) // experts.gate_up_proj.shape[0]
            total -= per_expert * (experts.gate_up_proj.shape[0] - top_k)
    return total


def experts_touched(runner: ModelRunner, ids: torch.Tensor) -> float:
    """Mean over sparse layers of the distinct experts a forward of ``ids`` routes to (the forward is rolled back)."""
    counts = []

    def count(module: SparseMoe, args: tuple, _output: torch.Tensor) -> None:
        hidden = args[0].reshape(-1, args[0].shape[-1])
        logits = module.gate(hidden[: ids.shape[1]])
        counts.append(len(torch.topk(logits, module.top_k, dim=-1).indices.unique()))

    hooks = [
        layer.mlp.register_forward_hook(count) for layer in runner.model.layers if isinstance(layer.mlp, SparseMoe)
    ]
    start = runner.length()
    try:
        runner.forward(ids)
    finally:
        for hook in hooks:
            hook.remove()
        runner.truncate(start)
    return statistics.mean(counts)


def forward_ms(runner: ModelRunner, ids: torch.Tensor) -> float:
    start_len = runner.length()
    start = time.perf_counter()
    runner.forward(ids)
    spent = time.perf_counter() - start
    runner.truncate(start_len)
    return spent * 1000


def measure(cfg: MoeRowsConfig) -> dict:
    apply_threads(cfg)
    generator = torch.Generator().manual_seed(0)
    text = torch.randint(0, cfg.vocab, (1, cfg.context), generator=generator)
    continuation = torch.randint(0, cfg.vocab, (1, max(cfg.rows)), generator=generator)
    models = targets(cfg)
    if cfg.routing not in ("random", "spread"):
        raise ValueError(f"routing must be random or spread, got {cfg.routing!r}")
    if cfg.routing == "spread":
        spread_routers(models["moe"], torch.cat([text, continuation], dim=1))
    rows = []
    for path in cfg.paths:
        runners = {
            name: ModelRunner.from_hf_model(model, max_seq_len=cfg.context + max(cfg.rows) + 8, exact=path == "exact")
            for name, model in models.items()
        }
        for runner in runners.values():
            runner.forward(text)
            for t in cfg.rows:  # first calls pay for packing weights and choosing kernels
                forward_ms(runner, continuation[:, :t])
        for t in cfg.rows:
            times: dict[str, list[float]] = {name: [] for name in runners}
            for _ in range(cfg.repeats):
                for name, runner in runners.items():
                    times[name].append(forward_ms(runner, continuation[:, :t]))
            for name, runner in runners.items():
                rows.append(
                    {
                        "target": name,
                        "path": runner.exactness.path,
                        "rows": t,
                        "ms": round(statistics.median(times[name]), 3),
                        "experts_touched": round(experts_touched(runner, continuation[:, :t]), 2)
                        if name == "moe"
                        else None,
                    }
                )
        active = {name: active_parameters(runner, cfg.top_k) for name, runner in runners.items()}
        del runners
    for row in rows:
        base = next(r["ms"] for r in rows if (r["target"], r["path"], r["rows"]) == (row["target"], row["path"], 1))
        row["x_decode"] = round(row["ms"] / base, 3)  # also the break-even τ of a T-row verification
        row["ms_per_token"] = round(row["ms"] / row["rows"], 3)
    return {
        "config": OmegaConf.to_container(cfg) if OmegaConf.is_config(cfg) else asdict(cfg),
        "active_parameters": active,
        "rows": rows,
        "expected_experts_uniform": {
            t: round(cfg.experts * (1 - (1 - cfg.top_k / cfg.experts) ** t), 2) for t in cfg.rows
        },
    }


def table(result: dict) -> str:
    cfg = result["config"]
    lines = [
        f"Target forward of T new tokens over {cfg['context']} cached, fp32, {cfg['threads']} thread(s), median "
        f"of {cfg['repeats']}; MoE: {cfg['experts']} experts, top-{cfg['top_k']} of width {cfg['expert_width']}, "
        f"{cfg['routing']} routing; "
        f"active parameters {result['active_parameters']}",
        "",
        "| path | T | dense ms | dense × decode | MoE ms | MoE × decode (break-even τ) | MoE ÷ dense | "
        "experts touched / layer (uniform: expected) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["target"], r["path"], r["rows"]): r for r in result["rows"]}
    for path in dict.fromkeys(r["path"] for r in result["rows"]):
        for t in cfg["rows"]:
            dense, moe = by[("dense", path, t)], by[("moe", path, t)]
            lines.append(
                f"| {path} | {t} | {dense['ms']:.1f} | {dense['x_decode']:.2f} | {moe['ms']:.1f} | "
                f"{moe['x_decode']:.2f} | {moe['ms'] / dense['ms']:.2f} | {moe['experts_touched']:.1f} "
                f"({result['expected_experts_uniform'][t]:.1f}) |"
            )
    return "\n".join(lines)


def run(cfg: MoeRowsConfig) -> str:
    result = measure(cfg)
    if cfg.out:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    return table(result)


def parse_args(argv: Sequence[str]) -> Any:
    return parse_bench(argv, MoeRowsConfig, USAGE)


def main(argv: list[str] | None = None) -> int:
    return run_cli(argv, lambda args: run(parse_args(args)), doc=__doc__, schema=MoeRowsConfig, report=print)


if __name__ == "__main__":
    sys.exit(main())
