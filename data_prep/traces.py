"""``python -m data_prep.traces target=smollm2 drafter=PATH source=mt_bench n_samples=N gamma=7 [positions=sps|specbranch] out=DIR``

Records H-RAD's features and labels on the first user turn of each prompt, at one of two kinds of position:

- ``positions=sps`` (default): runs chain speculative decoding (``inference.algorithms.sps``) and records every
  verification round (a round start: after a correction or bonus token), also the bandit's replay data;
- ``positions=specbranch``: runs SpecBranch (``inference.algorithms.specbranch``, ``kmax``, the branch points
  placed by ``policy``: ``none`` = the confidence rule, ``class0``/``class2``, an oracle, or an H-RAD export) and
  records every surviving branch, i.e. exactly where serving asks H-RAD: after a rejection, and at the
  low-confidence cut positions the confidence rule leaves. The label is realised by one extra target pass over the
  survivor's γ-1 continuation tokens (greedy at T = 0; at T > 0 the deterministic-draft rule on a generator of
  its own), which does not change the generation.

One row per round (or surviving branch), written with the same shard writer, manifest and resume rules as
``data_prep.extract``:

- ``sample_index``: source item; ``round``: round number within that generation (from 0)
- ``position``: position of the branch token in the sequence (prompt + tokens emitted before it)
- ``branch_token``: the first drafted token (``draft_tokens[0]``; with ``positions=specbranch`` the survivor's
  branch token, of draft rank ``branch_rank``)
- ``hidden_lastk`` [K*H]: the target's last K HF ``hidden_states`` entries at ``position - 1`` (the position
  whose output predicts the branch token), concatenated: raw outputs of decoder layers L-K .. L-2, then the
  final-normed state (SpecBranch's H-RAD convention; ``core.layer_ids``)
- ``draft_tokens`` [γ], ``draft_probs`` [γ] (temperature-1 draft probability of each drafted token; with
  ``positions=specbranch`` NaN for a branch token of rank > 0, whose probability the draft side does not return),
  ``draft_max_probs`` [γ] (max of that distribution: SpecBranch's confidence; ``[1]`` is the draft's confidence at
  the first continuation token, an optional H-RAD feature)
- ``num_accepted``: leading drafted tokens the target kept (the branch token is the first); ``draft_len``: γ
  of the round (smaller near the token budget)
- ``positions=specbranch`` only: ``branch_rank`` (which branch survived) and ``kept`` (continuation tokens the
  recording policy kept)

``hrad_class`` turns a row into SpecBranch's 3-way label. Prompts that do not fit ``max_seq_len`` with
``max_new_tokens`` are skipped (counted in the manifest), as are generations that end before any round.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from core.assets import model_identity
from core.atomic import check_output
from core.layer_ids import LAYER_CONVENTION, resolve_layers
from core.overrides import OverrideError, parse_cli, run_cli
from core.prompts import prompt_turns, render_prompt
from data_prep.capture import DTYPE_NAMES, storage_dtype
from data_prep.manifest import new_header, refuse_other_args, target_identity, tokenizer_identity
from data_prep.ranks import dataset_part, my_items
from data_prep.samples import load_source
from data_prep.shards import ShardWriter, column
from inference.algorithms.options import oracle_temperature_error
from inference.algorithms.specbranch import BranchPoint, SpecBranch
from inference.algorithms.sps import RoundInfo, SpeculativeSampling
from inference.drafters import eos_token_ids, load_draft_lm, load_lm
from inference.runner_loading import with_logit_vocab
from inference.sampling import SamplingParams

USAGE = (
    "python -m data_prep.traces target=smollm2 drafter=PATH source=mt_bench n_samples=N gamma=7 "
    "temperature=0 [positions=sps|specbranch] out=DIR"
)
POSITIONS = ("sps", "specbranch")


@dataclass
class TracesConfig:
    target: str = "smollm2"
    drafter: str | None = None  # a draft LM sharing the target's tokenizer
    source: str = "sharegpt"
    split: str = "all"
    n_samples: int = 100  # prompts
    gamma: int = 7  # draft length per round (SpecBranch's H-RAD uses 7)
    temperature: float = 0.0
    verifier: str = "tokenwise"
    draft_vocab: int = 0  # as the engine's draft_vocab: record the drafter as it will serve (0 = every id)
    max_new_tokens: int = 256
    last_k: int = 4  # hidden_states entries recorded per round (H-RAD: 4)
    dtype: str = "bf16"  # storage dtype of hidden_lastk
    shard_size: int = 4096  # rounds per shard (committed at prompt boundaries)
    seed: int = 0
    device: str = "auto"
    max_seq_len: int = 2048
    chat_template: str = "auto"  # how prompts are rendered: auto (the tokenizer's) | none (text as is) | PATH (Jinja)
    # sps: SpS round starts | specbranch: SpecBranch's surviving branches, where serving asks H-RAD
    positions: str = "sps"
    policy: str = "none"  # positions=specbranch: what places the branch points (SpecBranch's hrad=)
    kmax: int = 3  # positions=specbranch: most branches per branch point (SpecBranch's specbranch_kmax)
    out: str | None = None


def hrad_class(num_accepted: int, draft_len: int) -> int | None:
    """SpecBranch's H-RAD label for a round (docs/algorithms/specbranch.md §3): among the continuation
    tokens after an accepted branch token, 0 = none accepted, 2 = all (``draft_len - 1``) accepted, 1 = some.
    None when the branch token itself was rejected (H-RAD only runs on a surviving branch)."""
    if num_accepted == 0:
        return None
    continuation = num_accepted - 1
    return 0 if continuation == 0 else 2 if continuation == draft_len - 1 else 1


def trace_columns(hidden: int, last_k: int, dtype: str, positions: str = "sps") -> dict[str, dict[str, Any]]:
    columns = {
        "sample_index": column("int64", [], "source item (prompt) index"),
        "round": column("int32", [], "verification round within the generation, from 0"),
        "position": column("int32", [], "sequence position of the branch token (first drafted token)"),
        "branch_token": column("int32", [], "the first drafted token"),
        "hidden_lastk": column(
            DTYPE_NAMES[dtype],
            [last_k * hidden],
            f"last {last_k} HF hidden_states entries at position - 1, concatenated",
        ),
        "draft_tokens": column("int32", ["T"], "drafted chain (T = draft length)"),
        "draft_probs": column("float32", ["T"], "temperature-1 draft probability of each drafted token"),
        "draft_max_probs": column("float32", ["T"], "max of the temperature-1 draft distribution per step"),
        "num_accepted": column("int32", [], "leading drafted tokens kept by the verifier"),
        "draft_len": column("int32", [], "drafted tokens this round"),
    }
    if positions == "specbranch":
        columns["num_accepted"] = column("int32", [], "1 + continuation tokens the target accepts (extra pass)")
        columns["branch_rank"] = column("int32", [], "which branch survived (0 = the draft's most probable token)")
        columns["kept"] = column("int32", [], "continuation tokens the recording policy kept")
    return columns


def parse_args(argv: Sequence[str]) -> Any:
    cfg = parse_cli(argv, TracesConfig, USAGE)
    if not cfg.out:
        raise OverrideError(f"out=DIR is required; usage: {USAGE}")
    check_output(cfg.out)
    if not cfg.drafter:
        raise OverrideError(f"drafter=PATH is required (a draft LM for this target); usage: {USAGE}")
    storage_dtype(cfg.dtype)
    for key in ("n_samples", "gamma", "max_new_tokens", "shard_size", "max_seq_len", "kmax"):
        if cfg[key] < 1:
            raise OverrideError(f"{key} must be >= 1, got {cfg[key]}")
    if cfg.positions not in POSITIONS:
        raise OverrideError(
            f"positions={cfg.positions} is not one of {', '.join(POSITIONS)} (sps: SpS round starts; "
            "specbranch: where serving asks H-RAD)"
        )
    defaults = TracesConfig()
    if cfg.positions == "sps" and (cfg.policy != defaults.policy or cfg.kmax != defaults.kmax):
        raise OverrideError("policy and kmax place SpecBranch's branch points: set positions=specbranch, or drop them")
    if cfg.positions == "specbranch":
        if cfg.gamma < 2:
            raise OverrideError(
                f"positions=specbranch needs gamma >= 2 (a branch token and its continuation), got {cfg.gamma}"
            )
        if cfg.verifier != defaults.verifier:
            raise OverrideError(
                f"verifier={cfg.verifier} is SpS's; positions=specbranch verifies with SpecBranch's "
                "Match: drop verifier"
            )
        if error := oracle_temperature_error(cfg.policy, cfg.temperature):
            raise OverrideError(error)
    return cfg


def record_traces(cfg: Any, target=None, draft=None) -> dict[str, Any]:
    """Run (or resume) trace collection; returns the final manifest. ``target``/``draft``: preloaded models."""
    from tqdm.auto import tqdm  # tqdm: a heavy import, deferred to first use

    out = Path(cfg.out)
    args = OmegaConf.to_container(cfg, resolve=True)
    args.pop("out")
    if args["chat_template"] == "auto":  # the default, and what trace sets made before the option hold
        args.pop("chat_template")
    if args["positions"] == "sps":  # likewise: trace sets made before positions= are SpS round starts
        for key in ("positions", "policy", "kmax"):
            args.pop(key)
    refuse_other_args(out, args)
    process = dataset_part(out, args, "data_prep.traces ...")  # under torchrun: every world-th prompt from rank
    rank, world, part = process.rank, process.world, process.name
    if (finished := process.finished()) is not None:
        print(f"[traces] {out} is already complete", file=sys.stderr)
        return finished
    target = target or load_lm(
        cfg.target, device=cfg.device, max_seq_len=cfg.max_seq_len, chat_template=cfg.chat_template
    )
    draft = draft or load_draft_lm(cfg.drafter, target, device=cfg.device, max_seq_len=cfg.max_seq_len)
    config = target.runner.config
    num_layers = config.num_hidden_layers
    capture = resolve_layers(f"last{cfg.last_k}", num_layers)  # + the final-normed state
    header = new_header(
        "traces",
        args,
        target_identity(cfg.target, config),
        tokenizer_identity(target.tokenizer),
        trace_columns(config.hidden_size, cfg.last_k, cfg.dtype, cfg.positions),
        drafter=model_identity(str(cfg.drafter)),
        layers={"spec": f"last{cfg.last_k}", "ids": capture, "plus_final_norm": True, "convention": LAYER_CONVENTION},
        compute={"device": target.runner.device.type, "dtype": str(target.runner.dtype).removeprefix("torch.")},
    )
    rows: list[dict[str, Any]] = []

    def on_round(info: RoundInfo) -> None:
        hidden = torch.cat([info.hidden[i] for i in capture] + [info.last_hidden])
        rows.append(
            {
                "round": info.index,
                "position": info.prefix_len,
                "branch_token": info.draft_tokens[0],
                "hidden_lastk": hidden,
                "draft_tokens": info.draft_tokens,
                "draft_probs": info.draft_probs,
                "draft_max_probs": info.draft_max_probs,
                "num_accepted": info.num_accepted,
                "draft_len": len(info.draft_tokens),
            }
        )

    def on_branch(point: BranchPoint) -> None:
        hidden = torch.cat([point.hidden[i] for i in capture] + [point.last_hidden])
        # the continuation tokens are argmax drafts (probability = confidence); a branch token of rank > 0 has a
        # probability the draft side does not return
        probs = [point.confidence[0] if point.rank == 0 else math.nan, *point.confidence[1:]]
        rows.append(
            {
                "round": point.round,
                "position": point.position,
                "branch_token": point.tokens[0],
                "hidden_lastk": hidden,
                "draft_tokens": list(point.tokens),
                "draft_probs": probs,
                "draft_max_probs": list(point.confidence),
                "num_accepted": point.realised + 1,
                "draft_len": len(point.tokens),
                "branch_rank": point.rank,
                "kept": point.keep,
            }
        )

    draft_runner = with_logit_vocab(draft.runner, cfg.draft_vocab)
    if cfg.positions == "sps":
        sps = SpeculativeSampling(
            target.runner,
            draft_runner,
            gamma=cfg.gamma,
            verifier=cfg.verifier,
            on_round=on_round,
            round_capture_layers=capture,
        )
    else:
        sps = SpecBranch(
            target.runner,
            draft_runner,
            gamma=cfg.gamma,
            kmax=cfg.kmax,
            hrad=cfg.policy,
            on_branch=on_branch,
            branch_capture_layers=capture,
            branch_seed=cfg.seed,
        )
    sampling = SamplingParams(cfg.temperature)
    eos = eos_token_ids(target.tokenizer, target.model.config)

    with ShardWriter(out, header, cfg.shard_size, part=part) as writer:
        if writer.complete and not part:
            print(f"[traces] {out} is already complete ({writer.manifest['num_rows']} rounds)", file=sys.stderr)
            return writer.manifest
        conversations = load_source(cfg.source, cfg.n_samples, cfg.seed, cfg.split)
        items = my_items(len(conversations), rank, world)
        start = writer.next_source_index
        if start and not writer.complete:
            print(
                f"[traces] resuming {out} at prompt {start} of {len(items)} ({writer.manifest['num_rows']} rounds "
                "so far)",
                file=sys.stderr,
            )
        new_tokens, rounds, t0 = 0, 0, time.perf_counter()
        with tqdm(
            total=len(items),
            initial=start,
            desc="traces",
            unit="prompt",
            file=sys.stderr,
            dynamic_ncols=True,
            position=rank,
        ) as progress:
            for position in range(start, len(items)):
                index = items[position]
                ids = render_prompt(target.tokenizer, prompt_turns(conversations[index]))
                rows.clear()
                if len(ids) + cfg.max_new_tokens + sps.lookahead() <= sps.max_seq_len:
                    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + index)
                    result = sps.generate(
                        ids, max_new_tokens=cfg.max_new_tokens, sampling=sampling, generator=generator, eos_ids=eos
                    )
                    new_tokens += result.stats.new_tokens
                for row in rows:
                    row["sample_index"] = index
                writer.add(list(rows), source_end=position + 1, skipped=0 if rows else 1)
                rounds += len(rows)
                progress.update(1)
                progress.set_postfix(rounds=rounds, tok_s=f"{new_tokens / max(time.perf_counter() - t0, 1e-9):,.1f}")
        manifest = writer.finish()
    getattr(sps, "close", lambda: None)()  # SpecBranch's executor
    manifest = process.merged(manifest)
    print(
        f"[traces] wrote {manifest['num_rows']} rounds from {manifest['next_source_index'] - manifest['skipped']} "
        f"prompts ({manifest['skipped']} skipped) to {out}",
        file=sys.stderr,
    )
    return manifest


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(argv, lambda args: record_traces(parse_args(args)), doc=__doc__, schema=TracesConfig)


if __name__ == "__main__":
    sys.exit(main())
