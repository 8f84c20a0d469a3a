"""Replace a conversation's assistant turns with the target's own answers, generated with the engine.

``python -m data_prep.regenerate target=smollm2 source=gsm_symbolic_train n_samples=N out=FILE.jsonl``

answers many prompts at once (``inference.batched_generation``: ``batch_size`` rows, continuous batching) and
writes one JSON line per conversation (``messages``; the first line records the settings and the runner's
``exactness``: on a CPU, in fp32 and bf16, each batched answer is bitwise the one-prompt AR answer), readable by every
``source=jsonl:FILE.jsonl`` consumer (extract, online training, vocab, traces). It is resumable: a line is
written only once its conversation is complete, so after a kill (even -9) the same command carries on with no
lost or duplicated conversation (a torn last line is dropped), and other settings into an existing FILE are
refused. When all are done the file is rewritten in source order, so it does not depend on batching.

``Regenerator`` below is the one-conversation form ``extract regenerate=true`` uses.

Training a drafter on the target's own outputs is the standard fix for low acceptance (USER_PAIN_POINTS 1).
Turn k is answered conditioned on the target's earlier answers (``prompt_turns``). Answers stop at the
target's EOS or when the conversation reaches ``max_len`` tokens (nothing past it is trained on). Sampling
(``temperature > 0``) draws from a generator seeded by (seed, source index), so a resumed run regenerates
exactly what an uninterrupted one would.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from core.atomic import atomic_write_text
from core.errors import UserError
from core.overrides import OverrideError, parse_cli, run_cli
from core.prompts import JSONL_HEADER_KEY as HEADER_KEY
from core.prompts import Conversation, load_prompts, prompt_turns, render_prompt
from data_prep.ranks import launch_rank, my_items, part_name, part_worlds, refuse_other_world, wait_for
from inference.algorithms import build_algorithm
from inference.batched_generation import ContinuousBatcher, Job
from inference.drafters import eos_token_ids, load_lm, model_dtype, pick_device
from inference.sampling import SamplingParams

USAGE = (
    "python -m data_prep.regenerate target=smollm2 source=gsm_symbolic_train n_samples=N max_len=L "
    "batch_size=16 out=FILE.jsonl"
)


def job_seed(seed: int, index: int, turn: int = 0) -> int:
    """The sampling stream of (source item, turn): independent of batching, so a resumed run redraws the same."""
    return seed * 1_000_003 + index + (turn << 40)  # turn 0: the stream extract's Regenerator has always used


class Regenerator:
    def __init__(
        self,
        runner,
        tokenizer,
        eos_ids: list[int],
        *,
        max_len: int,
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
    ):
        if max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if runner.max_seq_len < max_len + 1:
            raise UserError(
                f"the target runner holds {runner.max_seq_len} tokens; regenerating up to "
                f"max_len={max_len} needs max_seq_len >= {max_len + 1}"
            )
        self.algorithm = build_algorithm("ar", runner)
        self.tokenizer = tokenizer
        self.eos_ids = list(eos_ids)
        self.max_len = max_len
        self.max_new_tokens = max_new_tokens
        self.sampling = SamplingParams(temperature)
        self.seed = seed

    def describe(self) -> dict:
        """What the manifest records about regeneration."""
        return {
            "engine": "inference.algorithms.ar",
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.sampling.temperature,
            "seed": self.seed,
        }

    def __call__(self, index: int, conversation: Conversation) -> Conversation:
        generator = torch.Generator().manual_seed(job_seed(self.seed, index))
        answers: list[str] = []
        n_users = len(conversation.user_turns)
        while len(answers) < n_users:
            turns = prompt_turns(conversation, answers)
            ids = render_prompt(self.tokenizer, turns)
            budget = min(self.max_new_tokens, self.max_len - len(ids))
            if budget < 1:  # the prompt alone fills max_len: later turns would be cut off anyway
                break
            tokens = self.algorithm.generate(
                ids, max_new_tokens=budget, sampling=self.sampling, generator=generator, eos_ids=self.eos_ids
            ).tokens
            if tokens and tokens[-1] in self.eos_ids:
                tokens = tokens[:-1]  # the chat template adds the end-of-turn token itself
            answers.append(self.tokenizer.decode(tokens, skip_special_tokens=True))
        if not answers:
            return Conversation(conversation.id, prompt_turns(conversation), conversation.source, conversation.meta)
        turns = prompt_turns(conversation, answers[:-1]) + [{"role": "assistant", "content": answers[-1]}]
        return Conversation(conversation.id, turns, conversation.source, {**conversation.meta, "regenerated": True})


# ------------------------------------------------------------------------------------------------ batched CLI


@dataclass
class RegenerateConfig:
    target: str = "smollm2"
    source: str = "sharegpt"  # any prompt source: sharegpt, gsm_symbolic_train, jsonl:PATH, ...
    split: str = "all"  # all | train | eval (stable hash split, core.prompts)
    n_samples: int = 1000  # source conversations to answer
    seed: int = 0  # selects procedural items (gsm_symbolic*) and the sampling streams
    max_len: int = 1024  # tokens per conversation, prompt and answers (nothing past it is trained on)
    max_new_tokens: int = 512  # per answer
    temperature: float = 0.0  # 0 = greedy (the target's own argmax: what a greedy drafter must predict)
    top_k: int = 0
    top_p: float = 1.0
    batch_size: int = 16  # rows answered side by side
    device: str = "auto"
    dtype: str = "auto"  # the target's compute dtype (inference.drafters.model_dtype): the answers depend on it
    chat_template: str = "auto"  # how prompts are rendered: auto (the tokenizer's) | none (text as is) | PATH (Jinja)
    out: str | None = None  # FILE.jsonl


# They change speed or how much is written, not what a record holds: item i's prompt does not depend on
# n_samples (sources are prefix-stable), so a re-run with a larger n_samples extends a file.
RUN_ONLY_KEYS = ("n_samples", "batch_size", "device", "out")
# Settings added after files were written, with the value those files were written with.
LATER_KEYS = {"chat_template": "auto"}


def parse_args(argv: Sequence[str]) -> Any:
    cfg = parse_cli(argv, RegenerateConfig, USAGE)
    if not cfg.out:
        raise OverrideError(f"out=FILE.jsonl is required; usage: {USAGE}")
    for key in ("n_samples", "max_len", "max_new_tokens", "batch_size"):
        if cfg[key] < 1:
            raise OverrideError(f"{key} must be >= 1, got {cfg[key]}")
    SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
    try:
        model_dtype(cfg.dtype, pick_device(cfg.device))
    except ValueError as exc:
        raise OverrideError(str(exc)) from None
    out = Path(cfg.out)
    if out.is_dir():
        raise OverrideError(f"out={out} is a directory; give a file path such as {out}/regenerated.jsonl")
    return cfg


def settings(cfg: Any) -> dict[str, Any]:
    args = OmegaConf.to_container(cfg, resolve=True)
    return {k: v for k, v in args.items() if k not in RUN_ONLY_KEYS}


def read_done(path: Path, header: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Finished records of an earlier run of the same settings, by source index; drops a torn last line."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    cut = data.rfind(b"\n") + 1
    if cut < len(data):  # killed mid-write: that conversation is answered again
        with open(path, "r+b") as handle:
            handle.truncate(cut)
        data = data[:cut]
    lines = data.decode("utf-8").splitlines()
    if not lines:
        return {}
    try:
        first = json.loads(lines[0])
    except json.JSONDecodeError:
        first = None
    if not isinstance(first, dict) or HEADER_KEY not in first:
        raise UserError(f"{path} exists and is not a data_prep.regenerate output; choose another out= or remove it")
    written = {**LATER_KEYS, **first[HEADER_KEY].get("settings", {})}
    diffs = {k: (written.get(k), v) for k, v in header["settings"].items() if written.get(k) != v}
    if diffs:
        key, (old, new) = next(iter(diffs.items()))
        raise UserError(
            f"{path} was written with other settings ({key}={old!r}, now {new!r}; {len(diffs)} differ); "
            "use the same settings to resume, or another out="
        )
    done = {}
    for lineno, line in enumerate(lines[1:], start=2):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(
                f"{path}:{lineno}: damaged line ({err.msg}); remove that line and re-run to redo it"
            ) from None
        done[int(record["source_index"])] = record
    return done


class _ConversationQueue:
    """Turns become jobs one at a time: turn k of a conversation is asked once turn k-1 is answered."""

    def __init__(self, conversations: list[Conversation], todo: list[int], tokenizer, cfg: Any):
        self.conversations, self.tokenizer, self.cfg = conversations, tokenizer, cfg
        self.waiting = deque(todo)  # source indices whose first turn is not asked yet
        self.ready: deque[Job] = deque()  # follow-up turns, asked before new conversations
        self.answers: dict[int, list[str]] = {}
        self.finished: list[tuple[int, list[str]]] = []

    def next_job(self) -> Job | None:
        while self.ready or self.waiting:
            if self.ready:
                return self.ready.popleft()
            index = self.waiting.popleft()
            self.answers[index] = []
            job = self._job(index)
            if job is not None:
                return job
        return None

    def _job(self, index: int) -> Job | None:
        """The job for the conversation's next turn, or None (and the conversation finishes) if none is left."""
        conversation, answers = self.conversations[index], self.answers[index]
        if len(answers) < len(conversation.user_turns):
            ids = render_prompt(self.tokenizer, prompt_turns(conversation, answers))
            budget = min(self.cfg.max_new_tokens, self.cfg.max_len - len(ids))
            if budget >= 1:
                return Job((index, len(answers)), ids, budget, job_seed(self.cfg.seed, index, len(answers)))
        self.finished.append((index, self.answers.pop(index)))
        return None

    def answered(self, job: Job, tokens: list[int], eos: set[int]) -> None:
        index, _ = job.key
        if tokens and tokens[-1] in eos:
            tokens = tokens[:-1]  # the chat template adds the end-of-turn token itself
        self.answers[index].append(self.tokenizer.decode(tokens, skip_special_tokens=True))
        follow_up = self._job(index)
        if follow_up is not None:
            self.ready.append(follow_up)


def record_of(index: int, conversation: Conversation, answers: list[str]) -> dict[str, Any] | None:
    if not answers:  # the prompt alone fills max_len
        return None
    turns = prompt_turns(conversation, answers[:-1]) + [{"role": "assistant", "content": answers[-1]}]
    return {"id": conversation.id, "source_index": index, "messages": turns}


def regenerate(cfg: Any, target=None) -> dict[str, Any]:
    """Run (or resume) a batched regeneration; returns counts and this run's throughput."""
    out = Path(cfg.out)
    header = {"settings": settings(cfg)}
    rank, world = launch_rank()
    refuse_other_world(
        part_worlds(p.name for p in out.parent.glob(f"{out.name}.rank-*")) or {world},
        world,
        out,
        "data_prep.regenerate ...",
    )
    path = out if world == 1 else part_file(out, rank, world)  # where this process writes
    done = read_done(out, header)  # refuses other settings before any model loads
    if world > 1:  # an earlier run's marker says nothing about this run's part
        done_marker(path).unlink(missing_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    conversations = load_prompts(cfg.source, n=cfg.n_samples, seed=cfg.seed, split=cfg.split)
    if not conversations:
        raise UserError(f"source '{cfg.source}' (split={cfg.split}) gave no conversations")
    items = my_items(len(conversations), rank, world)
    if world > 1:  # this process's items: finished in out (an earlier run) or in its own part
        mine = set(items)
        done = {i: r for i, r in {**done, **read_done(path, header)}.items() if i in mine}
    if target is None:
        # Spare rows: new prompts are prefilled apart from the running batch (inference.batched_generation).
        target = load_lm(
            cfg.target,
            device=cfg.device,
            max_seq_len=cfg.max_len + 1,
            max_batch_size=2 * cfg.batch_size,
            dtype=model_dtype(cfg.dtype, pick_device(cfg.device)),
            chat_template=cfg.chat_template,
        )
    eos = eos_token_ids(target.tokenizer, target.model.config)
    header["target"] = cfg.target
    # Whether each answer is bitwise the one-prompt AR answer (exact mode covers batched CPU rows, fp32 and bf16).
    exact = target.runner.exactness
    header["exactness"] = {k: v for k, v in exact.as_dict().items() if k != "probe_seconds"}
    print(f"[regenerate] {cfg.batch_size} rows side by side: {exact.summary()}", file=sys.stderr)
    todo = [i for i in items if i not in done]
    if done:
        print(f"[regenerate] resuming {path}: {len(done)} of {len(items)} conversations done", file=sys.stderr)
    queue = _ConversationQueue(conversations, todo, target.tokenizer, cfg)
    batcher = ContinuousBatcher(
        target.runner,
        batch_size=cfg.batch_size,
        eos_ids=eos,
        sampling=SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p),
    )
    if world > 1:  # the part holds exactly what done says (records found in out included)
        write_records(path, header, done)
    mode = "a" if path.exists() and path.stat().st_size else "w"
    start = time.perf_counter()
    with (
        open(path, mode, encoding="utf-8") as handle,
        tqdm(
            total=len(items),
            initial=len(done),
            desc="regenerate",
            unit="conv",
            file=sys.stderr,
            dynamic_ncols=True,
            position=rank,
        ) as progress,
    ):
        if mode == "w":
            handle.write(json.dumps({HEADER_KEY: header}) + "\n")

        def flush_finished() -> None:
            for index, answers in queue.finished:
                record = record_of(index, conversations[index], answers)
                if record is not None:
                    done[index] = record
                    handle.write(json.dumps(record, ensure_ascii=False) + "\n")  # one write: whole line or torn
                    handle.flush()
                progress.update(1)
            if queue.finished:
                os.fsync(handle.fileno())
                queue.finished.clear()
                elapsed = max(time.perf_counter() - start, 1e-9)
                progress.set_postfix(tok_s=f"{batcher.new_tokens / elapsed:.1f}")

        def on_done(job: Job, tokens: list[int]) -> None:
            queue.answered(job, tokens, set(eos))
            flush_finished()

        def next_job() -> Job | None:
            job = queue.next_job()
            flush_finished()  # conversations that finished without a job (prompt fills max_len)
            return job

        batcher.run(next_job, on_done)
    elapsed = time.perf_counter() - start
    # Source order, so the finished file does not depend on batching or on where a run was killed.
    write_records(path, header, done)
    if world > 1:
        atomic_write_text(done_marker(path), json.dumps({"conversations": len(conversations)}) + "\n")
        if rank == 0:
            merge_parts(out, header, world, len(conversations))
    answered = sum(1 for i in done if i < len(conversations))
    summary = {
        "conversations": answered,
        "skipped": len(items) - answered,
        "new_tokens": batcher.new_tokens,
        "wall_s": round(elapsed, 2),
        "tokens_per_s": round(batcher.new_tokens / max(elapsed, 1e-9), 2),
        "forwards": batcher.forwards,
        "exactness": exact.summary(),
    }
    print(
        f"[regenerate] {out}: {summary['conversations']} conversations ({summary['skipped']} without room for an "
        f"answer); this run {summary['new_tokens']:,} tokens in {elapsed:.1f} s = {summary['tokens_per_s']} tokens/s",
        file=sys.stderr,
    )
    return summary


def write_records(path: Path, header: dict[str, Any], done: dict[int, dict[str, Any]]) -> None:
    """The header line and the records in source order, atomically."""
    lines = [json.dumps({HEADER_KEY: header})] + [json.dumps(done[i], ensure_ascii=False) for i in sorted(done)]
    atomic_write_text(path, "\n".join(lines) + "\n")


def part_file(out: Path, rank: int, world: int) -> Path:
    """Process ``rank``'s own output beside ``out`` (``data_prep.ranks``): same format, its items only."""
    return out.with_name(f"{out.name}.{part_name(rank, world)}")


def done_marker(part: Path) -> Path:
    return part.with_name(part.name + ".done")


def part_finished(part: Path, conversations: int) -> bool:
    """Whether ``part`` is finished for a run over ``conversations`` source items: its marker says so. A marker an
    earlier run left (killed before rank 0 merged, then re-run with another n_samples) names another count."""
    try:
        return json.loads(done_marker(part).read_text()).get("conversations") == conversations
    except (FileNotFoundError, json.JSONDecodeError, AttributeError):
        return False  # not written yet, or in an older format: not this run's


def merge_parts(out: Path, header: dict[str, Any], world: int, conversations: int) -> None:
    """Rank 0, once every part is finished for this run's ``conversations``: one file in source order, written
    atomically; then the parts go."""
    parts = [part_file(out, rank, world) for rank in range(world)]
    wait_for(
        lambda: all(part_finished(p, conversations) for p in parts),
        f"the other {world - 1} process(es) to finish {out}",
    )
    done = read_done(out, header)
    for part in parts:
        done.update(read_done(part, header))
    write_records(out, header, done)
    for part in parts:  # markers last: a kill in between leaves parts a re-run merges again
        part.unlink(missing_ok=True)
        done_marker(part).unlink(missing_ok=True)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(argv, lambda args: regenerate(parse_args(args)), doc=__doc__, schema=RegenerateConfig)


if __name__ == "__main__":
    sys.exit(main())
