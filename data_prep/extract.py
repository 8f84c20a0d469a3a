"""``python -m data_prep.extract target=smollm2 source=sharegpt n_samples=N max_len=L layers=eagle3 out=DIR``

Writes a hidden-state feature dataset: Arrow shards plus ``manifest.json`` (docs/architecture.md §5.1). Per sample:
``input_ids``, ``loss_mask`` (assistant tokens), ``aux_hidden`` (the captured layers, concatenated) and
``last_hidden`` (after the final norm; the teacher distribution is recomputed as ``lm_head(last_hidden)`` at
training time instead of storing logits).

Keys: ``layers`` = eagle3 | lastK | [i,j,...] (output-of-layer ids, 0-based; ``core.layer_ids``),
``dtype`` = bf16 | fp16 | fp32 | fp8 (storage; fp8: float8_e4m3fn with a power-of-two scale per token and layer,
read back as bf16, ``data_prep.fp8``), ``regenerate=true`` answers the prompts with the target itself
(engine ``ar``; ``max_new_tokens``, ``temperature``: refused without it), ``split`` = all | train | eval,
``batch_size``, ``shard_size`` (samples per shard; default about 1 GB), ``device``, ``seed``, ``exact`` (the
target's exact CPU kernels; off: extraction verifies nothing, see ``ExtractConfig.exact``).

Re-running the same command after an interruption (even kill -9) resumes without losing or duplicating a
sample; other arguments into an existing DIR are refused (another dtype in one line: one dataset holds one storage
dtype). Before starting it prints the estimated disk size and refuses if free disk is short.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from core.atomic import check_output
from core.layer_ids import LAYER_CONVENTION, resolve_layers, spec_name
from core.overrides import OverrideError, leaf_keys, parse_cli, resolve_key, run_cli, split_key_values
from data_prep.capture import DTYPE_NAMES, FP8, HiddenCapture, check_feature_dtype
from data_prep.features import DEQUANTIZED_DTYPE
from data_prep.manifest import (
    MANIFEST_NAME,
    RANKS_DIR,
    DatasetError,
    new_header,
    read_manifest,
    refuse_other_args,
    target_identity,
    tokenizer_identity,
)
from data_prep.ranks import dataset_part, my_items
from data_prep.regenerate import Regenerator
from data_prep.samples import WINDOWS, SampleBuilder, TokenSample, load_source, require_answers
from data_prep.shards import STORAGE_DTYPE, ShardWriter, column
from inference.drafters import eos_token_ids, load_lm

USAGE = (
    "python -m data_prep.extract target=smollm2 source=sharegpt n_samples=N max_len=L layers=eagle3 dtype=bf16 out=DIR"
)
ESTIMATE_SAMPLES = 256  # conversations tokenized up front to estimate the dataset size
DISK_MARGIN = 1.10  # refuse unless free disk exceeds the estimate by this factor
SHARD_BYTES = 1 << 30  # auto shard size: a kill loses at most about this much work
# Arrow list offsets: 4 bytes per token for each [T, W] column's rows, plus per-sample overhead.
OFFSET_BYTES_PER_TOKEN = 4
FP8_STORAGE = "float8_e4m3fn"


@dataclass
class ExtractConfig:
    target: str = "smollm2"
    source: str = "sharegpt"
    split: str = "all"  # all | train | eval (stable hash split, core.prompts)
    n_samples: int = 1000  # source conversations to read; ones without assistant tokens are skipped
    max_len: int = 2048
    window: str = "start"  # start | answer: where a long conversation's max_len window sits (data_prep.samples)
    layers: Any = "eagle3"  # eagle3 | lastK | [i, j, ...]
    dtype: str = "bf16"  # storage dtype: bf16 | fp16 | fp32 | fp8 (per-token, per-layer scales; reads as bf16)
    batch_size: int = 8
    shard_size: int = 0  # samples per shard (committed atomically); 0 = auto, about SHARD_BYTES per shard
    seed: int = 0
    regenerate: bool = False  # replace assistant turns with the target's own answers
    chat_template: str = "auto"  # how conversations are rendered: auto (the tokenizer's) | none (text as is) | PATH
    max_new_tokens: int = 1024  # per regenerated answer
    temperature: float = 0.0  # for regenerated answers (0 = greedy)
    device: str = "auto"
    # The target's exact CPU kernels (docs/numerics.md): they make a sample's features bitwise independent of its
    # batch neighbours, which extraction does not need (it verifies no draft; training reads the features up to
    # rounding anyway), so it runs the plain kernels unless exact=true.
    exact: bool = False
    out: str | None = None


# Keys that do not change what is written; everything else must match to resume.
RUN_ONLY_KEYS = ("out",)
GENERATION_KEYS = ("max_new_tokens", "temperature")  # read only with regenerate=true


def parse_args(argv: Sequence[str]) -> Any:
    cfg = parse_cli(argv, ExtractConfig, USAGE)
    if not cfg.out:
        raise OverrideError(f"out=DIR is required; usage: {USAGE}")
    check_output(cfg.out)
    check_feature_dtype(cfg.dtype)
    for key in ("n_samples", "max_len", "batch_size"):
        if cfg[key] < 1:
            raise OverrideError(f"{key} must be >= 1, got {cfg[key]}")
    if cfg.window not in WINDOWS:
        raise OverrideError(f"window must be one of {', '.join(WINDOWS)}, got '{cfg.window}'")
    if cfg.shard_size < 0:
        raise OverrideError(f"shard_size must be >= 1 (or 0 for auto), got {cfg.shard_size}")
    if not cfg.regenerate:  # the source's own answers are extracted: nothing is generated
        valid = leaf_keys(OmegaConf.structured(ExtractConfig))
        given = [resolve_key(key, valid) for key, _ in split_key_values(argv, USAGE)]
        for key in GENERATION_KEYS:
            if key in given:
                raise OverrideError(
                    f"{key} does nothing with regenerate=false (the source's own answers are "
                    f"extracted, nothing is generated); set regenerate=true or drop {key}"
                )
    return cfg


def content_args(cfg: Any) -> dict[str, Any]:
    args = OmegaConf.to_container(cfg, resolve=True)
    for key in RUN_ONLY_KEYS:
        args.pop(key, None)
    for key, default in (("window", "start"), ("chat_template", "auto"), ("exact", False)):
        if args[key] == default:  # the default, and what datasets made before the option hold
            args.pop(key)
    if not args["regenerate"]:  # generation settings mean nothing without regeneration (and are refused)
        for key in GENERATION_KEYS:
            args.pop(key)
    return args


def feature_columns(layers: list[int], hidden: int, dtype: str) -> dict[str, dict[str, Any]]:
    fp8 = dtype == FP8
    logical = FP8_STORAGE if fp8 else DTYPE_NAMES[dtype]
    aux_meaning = f"outputs of decoder layers {layers} (0-based), concatenated in that order"
    columns = {
        "input_ids": column("int32", ["T"], "token ids (chat template applied)"),
        "loss_mask": column("int8", ["T"], "1 on assistant tokens (trained on), 0 elsewhere"),
        "aux_hidden": column(
            logical, ["T", len(layers) * hidden], aux_meaning, scale="aux_hidden_scale" if fp8 else None
        ),
        "last_hidden": column(
            logical,
            ["T", hidden],
            "final hidden state after the final norm",
            scale="last_hidden_scale" if fp8 else None,
        ),
    }
    if fp8:
        columns["aux_hidden_scale"] = column(
            "float32",
            ["T", len(layers)],
            f"power-of-two scale of aux_hidden per token and per layer block of {hidden} values: value = code x scale",
        )
        columns["last_hidden_scale"] = column("float32", ["T", 1], "power-of-two scale of last_hidden per token")
    return columns


def feature_storage(dtype: str) -> dict[str, Any]:
    """The manifest's ``feature_storage`` block of an fp8 dataset (absent otherwise, as in datasets made before
    fp8 existed: their column dtypes say everything)."""
    if dtype != FP8:
        return {}
    return {
        "feature_storage": {
            "dtype": FP8_STORAGE,
            "scaling": "power of two per token and per layer block",
            "scale_dtype": "float32",
            "reads_as": str(DEQUANTIZED_DTYPE).removeprefix("torch."),
        }
    }


def bytes_per_token(columns: dict[str, dict[str, Any]]) -> int:
    total = 0
    for spec in columns.values():
        width = spec["shape"][1] if len(spec["shape"]) == 2 else 1
        total += width * np.dtype(STORAGE_DTYPE[spec["dtype"]]).itemsize
        total += OFFSET_BYTES_PER_TOKEN if len(spec["shape"]) == 2 else 0
    return total


def refuse_mixed_dtype(out: Path, dtype: str) -> None:
    """Before anything else on a resume: one dataset holds one storage dtype (its readers decode every shard
    alike), so a run with another ``dtype`` into an existing DIR is refused naming both."""
    logs = [out / MANIFEST_NAME, *sorted((out / RANKS_DIR).glob("*.json"))]
    for log in logs:
        if log.is_file():
            stored = read_manifest(out, str(log.relative_to(out))).get("args", {}).get("dtype")
            if stored is not None and stored != dtype:
                raise DatasetError(
                    f"{out} stores dtype={stored} features; dtype={dtype} would mix two storage dtypes "
                    f"in one dataset: re-run with dtype={stored} to resume, or choose a new out=DIR"
                )
            return


def auto_shard_size(per_token: int, max_len: int, batch_size: int) -> int:
    """Samples per shard for about ``SHARD_BYTES`` at full length, a multiple of the batch size (so a resumed run
    forms the same batches as an uninterrupted one)."""
    batches = max(1, round(SHARD_BYTES / (per_token * max_len * batch_size)))
    return batches * batch_size


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def check_disk(out: Path, remaining_tokens: int, per_token: int, basis: str) -> int:
    """Print the estimated size of what is left to write; refuse (one line) if free disk is short."""
    estimate = remaining_tokens * per_token
    probe = out if out.exists() else next(p for p in out.parents if p.exists())
    free = shutil.disk_usage(probe).free
    print(
        f"[extract] estimated size: {_human(estimate)} (~{remaining_tokens:,} tokens x {per_token:,} bytes/token, "
        f"{basis}); free on {probe}: {_human(free)}",
        file=sys.stderr,
        flush=True,
    )
    if free < estimate * DISK_MARGIN:
        raise DatasetError(
            f"not enough free disk in {probe}: the dataset needs ~{_human(estimate)} (+10% margin) "
            f"but {_human(free)} is free; free space or lower n_samples/max_len (dtype=fp8 stores about "
            "half of bf16)"
        )
    return estimate


def _estimate_tokens(conversations, items: list[int], start: int, cfg: Any, build: SampleBuilder) -> tuple[int, str]:
    remaining = len(items) - start
    if remaining <= 0:
        return 0, "nothing left"
    if cfg.regenerate:
        return remaining * cfg.max_len, "upper bound: regenerated answers may fill max_len"
    probe = items[start : start + ESTIMATE_SAMPLES]
    lengths = [len(s) for i in probe if (s := build(i, conversations[i])) is not None]
    mean = sum(lengths) / max(len(probe), 1)
    basis = "measured" if len(probe) == remaining else f"mean of the next {len(probe)} samples"
    return int(mean * remaining), basis


def _batches(conversations, items: list[int], start: int, build: SampleBuilder, batch_size: int):
    """Yield (samples, end, skipped) with up to ``batch_size`` samples of the source items ``items[start:]``, in
    order; ``end`` is the position in ``items`` after the batch (what the shard writer logs)."""
    batch: list[TokenSample] = []
    skipped = 0
    for position in range(start, len(items)):
        index = items[position]
        sample = build(index, conversations[index])
        if sample is None:
            skipped += 1
        else:
            batch.append(sample)
        if len(batch) == batch_size:
            yield batch, position + 1, skipped
            batch, skipped = [], 0
    if batch or skipped:
        yield batch, len(items), skipped


def extract(cfg: Any, target=None) -> dict[str, Any]:
    """Run (or resume) an extraction; returns the final manifest. ``target``: a preloaded LoadedModel.

    Under torchrun each process extracts its slice of the source items (``data_prep.ranks``)."""
    out = Path(cfg.out)
    refuse_mixed_dtype(out, cfg.dtype)
    refuse_other_args(out, content_args(cfg))
    process = dataset_part(out, content_args(cfg), "data_prep.extract ...")
    if (finished := process.finished()) is not None:
        print(f"[extract] {out} is already complete", file=sys.stderr)
        return finished
    if target is None:
        target = load_lm(
            cfg.target,
            device=cfg.device,
            max_seq_len=cfg.max_len + 1,
            max_batch_size=cfg.batch_size,
            chat_template=cfg.chat_template,
            exact=cfg.exact,
        )
    runner, tokenizer = target.runner, target.tokenizer
    config = runner.config
    layers = resolve_layers(cfg.layers, config.num_hidden_layers)
    columns = feature_columns(layers, config.hidden_size, cfg.dtype)
    header = new_header(
        "features",
        content_args(cfg),
        target_identity(cfg.target, config),
        tokenizer_identity(tokenizer),
        columns,
        layers={"spec": spec_name(cfg.layers), "ids": layers, "convention": LAYER_CONVENTION},
        compute={"device": runner.device.type, "dtype": str(runner.dtype).removeprefix("torch.")},
        **feature_storage(cfg.dtype),
    )
    per_token = bytes_per_token(columns)
    shard_size = cfg.shard_size or auto_shard_size(per_token, cfg.max_len, cfg.batch_size)
    part = process.name
    done_tokens, t0 = 0, time.perf_counter()
    with ShardWriter(out, header, shard_size, part=part) as writer:
        if writer.complete and not part:
            print(f"[extract] {out} is already complete ({writer.manifest['num_rows']} samples)", file=sys.stderr)
            return writer.manifest
        manifest = writer.manifest
        if not writer.complete:  # a finished part still waits for the merge below
            done_tokens = _write_items(cfg, target, layers, writer, process.rank, process.world, per_token)
            manifest = writer.finish()
    manifest = process.merged(manifest)
    elapsed = time.perf_counter() - t0
    print(
        f"[extract] wrote {manifest['num_rows']} samples ({manifest['num_tokens']:,} tokens, {manifest['skipped']} "
        f"skipped) in {len(manifest['shards'])} shards to {out}; this run: {done_tokens:,} tokens in "
        f"{elapsed:.1f} s",
        file=sys.stderr,
    )
    return manifest


def _write_items(
    cfg: Any, target, layers: list[int], writer: ShardWriter, rank: int, world: int, per_token: int
) -> int:
    """Capture and write this process's source items from where its log stops; returns the tokens written."""
    from tqdm.auto import tqdm  # tqdm: a heavy import, deferred to first use

    runner, tokenizer, out = target.runner, target.tokenizer, writer.directory
    conversations = load_source(cfg.source, cfg.n_samples, cfg.seed, cfg.split)
    require_answers(conversations, cfg.regenerate, cfg.source)
    regenerator = None
    if cfg.regenerate:
        regenerator = Regenerator(
            runner,
            tokenizer,
            eos_token_ids(tokenizer, target.model.config),
            max_len=cfg.max_len,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            seed=cfg.seed,
        )
    build = SampleBuilder(tokenizer, cfg.max_len, regenerator, window=cfg.window)
    items = my_items(len(conversations), rank, world)
    start = writer.next_source_index
    who = f" (process {rank} of {world}: every {world}th source item from {rank})" if writer.part else ""
    if start:
        print(
            f"[extract] resuming {out}{who} at item {start} of {len(items)} ({writer.manifest['num_rows']} "
            f"samples in {len(writer.manifest['shards'])} shards)",
            file=sys.stderr,
        )
    tokens, basis = _estimate_tokens(conversations, items, start, cfg, build)
    check_disk(out, tokens, per_token, basis)

    capture = HiddenCapture(runner, layers, cfg.dtype)
    done_tokens, t0 = 0, time.perf_counter()
    with tqdm(
        total=len(items),
        initial=start,
        desc=f"extract{f' {rank}/{world}' if writer.part else ''}",
        unit="sample",
        file=sys.stderr,
        dynamic_ncols=True,
        position=rank,
    ) as progress:
        for samples, source_end, skipped in _batches(conversations, items, start, build, cfg.batch_size):
            rows = capture(samples) if samples else []
            n_tokens = sum(len(s) for s in samples)
            writer.add(rows, source_end=source_end, skipped=skipped, num_tokens=n_tokens)
            done_tokens += n_tokens
            progress.update(len(samples) + skipped)
            elapsed = max(time.perf_counter() - t0, 1e-9)
            progress.set_postfix(tok_s=f"{done_tokens / elapsed:,.0f}", shards=len(writer.manifest["shards"]))
    return done_tokens


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(argv, lambda args: extract(parse_args(args)), doc=__doc__, schema=ExtractConfig)


if __name__ == "__main__":
    sys.exit(main())
