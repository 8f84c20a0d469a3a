"""Prompt sources, deterministic train/eval splits, and chat templating with loss masks.

Sources (``load_prompts(source, ...)``):

- ``mt_bench``: the 80 MT-Bench questions; each ``Conversation`` holds BOTH user turns and no answers.
  Turn 2 needs the model's own turn-1 answer: use ``prompt_turns(conv)`` for the turn-1 prompt and
  ``prompt_turns(conv, [answer1])`` for the two-turn form.
- ``humaneval``: the 164 HumanEval problems; the user message is ``HUMANEVAL_INSTRUCTION`` followed by the
  problem's ``prompt`` field inside a Python code fence (see ``_humaneval_message``).
- ``sharegpt``: the packaged ShareGPT V3 JSON (~125 MB, ~17.7k records). The file is truncated mid-record, so
  it is decoded record by record and the cut-off tail is ignored. Roles ``human``/``user`` -> user,
  ``gpt``/``assistant`` -> assistant, ``system`` -> system; conversations with any other role (``bing``,
  ``bard``, ``chatgpt``) are dropped, and so are ones left without a user turn. Leading assistant turns
  (the file splits long chats, so continuation records start with ``gpt``) are dropped, as FastChat does.
- ``gsm_symbolic``: procedural grade-school math from ``reasoning_gym`` (seeded); the worked solution
  (``metadata.answer_cot``, else the bare answer) is kept as the assistant turn.
- ``gsm_symbolic_train``: the same generator from seeds that never meet the evaluation's. Item i of
  ``gsm_symbolic`` (seed s) is drawn from ``Random(s + i)``, so evaluation items use seeds below
  ``GSM_TRAIN_SEED`` and training items ``GSM_TRAIN_SEED + seed + i``: no training question is an evaluation
  question (the ~100 GSM-Symbolic templates are shared; their numbers and names are not).
- ``jsonl:PATH``: one JSON object per line with ``prompt`` (str), ``messages`` ([{role, content}]) or
  ``conversations`` ([{from, value}]), optionally ``id``. A first line holding only ``spectrain_regenerate``
  (the settings ``data_prep.regenerate`` records) is skipped.

``seed`` only affects procedural sources (``gsm_symbolic``); file sources keep their file order.

Splits are decided by a stable hash of the normalised first user message, so a prompt (and any duplicate of
it) always lands in the same split, across runs and across sources.

Chat templating renders with the TARGET's tokenizer. ``tokenize_conversation`` derives the loss mask from
incremental renders of the template (character spans mapped to tokens with offset mappings) instead of
hard-coded role strings, so it works for any prefix-stable template.
"""

from __future__ import annotations

import bisect
import gzip
import hashlib
import itertools
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core import assets
from core.errors import UserError

Turn = dict[str, str]
ROLES = ("system", "user", "assistant")
SOURCES = "mt_bench, humaneval, sharegpt, gsm_symbolic, gsm_symbolic_train, jsonl:PATH"
DEFAULT_EVAL_FRACTION = 0.05
GSM_DEFAULT_N = 1000
# Evaluation draws gsm_symbolic items from Random(0 .. GSM_TRAIN_SEED - 1), training from Random(>= GSM_TRAIN_SEED).
GSM_TRAIN_SEED = 10_000_000
JSONL_HEADER_KEY = "spectrain_regenerate"

HUMANEVAL_INSTRUCTION = "Complete the following Python function:\n"
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@dataclass
class Conversation:
    """One prompt source record: ``turns`` are ``{"role": system|user|assistant, "content": str}``."""

    id: str
    turns: list[Turn]
    source: str
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def first_user_message(self) -> str:
        return next(t["content"] for t in self.turns if t["role"] == "user")

    @property
    def user_turns(self) -> list[str]:
        return [t["content"] for t in self.turns if t["role"] == "user"]


# --------------------------------------------------------------------------------------------- helpers


def prompt_turns(conversation: Conversation, answers: Sequence[str] = ()) -> list[Turn]:
    """Generation prompt for user turn ``len(answers) + 1``, with the caller's answers in between.

    System turns are kept; the conversation's own assistant turns (if any) are replaced by ``answers``, since
    multi-turn benchmarks must condition turn k on the model's own earlier answers.
    ``prompt_turns(mt)`` is MT-Bench turn 1; ``prompt_turns(mt, [answer1])`` is turn 2.
    """
    n_user = len(conversation.user_turns)
    if len(answers) >= n_user:
        raise UserError(
            f"conversation {conversation.id} has {n_user} user turns; got {len(answers)} answers (at most {n_user - 1})"
        )
    out: list[Turn] = []
    users_seen = 0
    for turn in conversation.turns:
        if turn["role"] == "system":
            out.append(dict(turn))
        elif turn["role"] == "user":
            if users_seen > 0:
                out.append({"role": "assistant", "content": answers[users_seen - 1]})
            out.append(dict(turn))
            users_seen += 1
            if users_seen == len(answers) + 1:
                break
    return out


def _normalise(text: str) -> str:
    return " ".join(text.split()).casefold()


def split_of(conversation: Conversation, eval_fraction: float = DEFAULT_EVAL_FRACTION) -> str:
    """``"eval"`` or ``"train"``, from a stable hash of the normalised first user message."""
    digest = hashlib.sha256(_normalise(conversation.first_user_message).encode("utf-8")).digest()
    # 64-bit prefix as a uniform draw in [0, 1): stable across processes (unlike hash()) and Python versions.
    return "eval" if int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction else "train"


# --------------------------------------------------------------------------------------------- sources


def _data_file(name: str) -> Path:
    return assets.data_file(name)


def iter_mt_bench() -> Iterator[Conversation]:
    with open(_data_file("mt_bench"), encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                rec = json.loads(line)
                yield Conversation(
                    id=f"mt_bench/{rec['question_id']}",
                    turns=[{"role": "user", "content": text} for text in rec["turns"]],
                    source="mt_bench",
                    meta={"category": rec["category"], "reference": rec.get("reference")},
                )


def _humaneval_message(prompt: str) -> str:
    # A fenced block keeps the signature/docstring verbatim; the trailing newline keeps the fence on its own line.
    body = prompt if prompt.endswith("\n") else prompt + "\n"
    return f"{HUMANEVAL_INSTRUCTION}```python\n{body}```"


def iter_humaneval() -> Iterator[Conversation]:
    with gzip.open(_data_file("humaneval"), "rt", encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                rec = json.loads(line)
                yield Conversation(
                    id=rec["task_id"],
                    turns=[{"role": "user", "content": _humaneval_message(rec["prompt"])}],
                    source="humaneval",
                    meta={"entry_point": rec["entry_point"], "prompt": rec["prompt"]},
                )


def iter_json_array(text: str) -> Iterator[Any]:
    """Decode the elements of a JSON array one by one, stopping silently at a truncated final element.

    Streaming with ``raw_decode`` keeps every complete record of a cut-off file (``json.loads`` would reject
    the whole 125 MB) and lets callers stop early.
    """
    decoder = json.JSONDecoder()
    pos = text.find("[")
    if pos < 0:
        raise UserError("expected a JSON array")
    pos += 1
    end = len(text)
    while True:
        while pos < end and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= end or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield obj


def _sharegpt_turns(messages: Any) -> list[Turn] | None:
    """Mapped turns, or None when the record must be dropped (unknown role, malformed, no user turn)."""
    if not isinstance(messages, list):
        return None
    turns: list[Turn] = []
    for msg in messages:
        role = SHAREGPT_ROLES.get(msg.get("from")) if isinstance(msg, dict) else None
        if role is None or not isinstance(msg.get("value"), str):
            return None
        turns.append({"role": role, "content": msg["value"]})
    system = turns[:1] if turns and turns[0]["role"] == "system" else []
    rest = turns[len(system) :]
    # Continuation records (the file splits long chats) open with the assistant: start at the first user turn.
    first_user = next((i for i, t in enumerate(rest) if t["role"] == "user"), None)
    return None if first_user is None else system + rest[first_user:]


def iter_sharegpt(path: str | Path | None = None, stats: dict[str, int] | None = None) -> Iterator[Conversation]:
    """ShareGPT conversations in file order; ``stats`` (if given) is filled with records/kept/dropped."""
    path = Path(path) if path is not None else _data_file("sharegpt")
    text = path.read_text(encoding="utf-8")
    counts = stats if stats is not None else {}
    counts.update(records=0, kept=0, dropped=0)
    for index, rec in enumerate(iter_json_array(text)):
        counts["records"] += 1
        turns = _sharegpt_turns(rec.get("conversations")) if isinstance(rec, dict) else None
        if turns is None:
            counts["dropped"] += 1
            continue
        counts["kept"] += 1
        yield Conversation(id=str(rec.get("id", index)), turns=turns, source="sharegpt")


def sharegpt_stats(path: str | Path | None = None) -> dict[str, int]:
    """Counts for the whole file: complete ``records``, ``kept`` conversations and ``dropped`` ones."""
    stats: dict[str, int] = {}
    for _ in iter_sharegpt(path, stats):
        pass
    return stats


def iter_gsm_symbolic(seed: int = 0, size: int = GSM_DEFAULT_N, train: bool = False) -> Iterator[Conversation]:
    import reasoning_gym  # lazy: ~1.5 s import

    if not train and seed + size > GSM_TRAIN_SEED:
        raise UserError(
            f"gsm_symbolic seed={seed} with {size} items reaches the training seeds (>= {GSM_TRAIN_SEED}); "
            "use a smaller seed, or source=gsm_symbolic_train for training data"
        )
    if train:
        seed += GSM_TRAIN_SEED

    # reasoning_gym draws item i from Random(seed + i) and task ids from a prefix-stable choices() call, so
    # the first k items do not depend on ``size``.
    dataset = reasoning_gym.create_dataset("gsm_symbolic", seed=seed, size=size)
    for index in range(size):
        item = dataset[index]
        answer = item.get("metadata", {}).get("answer_cot") or item.get("answer")
        turns = [{"role": "user", "content": item["question"]}]
        if answer:
            turns.append({"role": "assistant", "content": str(answer)})
        yield Conversation(
            id=f"gsm_symbolic/{seed}/{index}",
            turns=turns,
            source="gsm_symbolic_train" if train else "gsm_symbolic",
            meta={"answer": item.get("answer")},
        )


JSONL_EXPECTED = (
    "expected a JSON object with 'prompt' (str, optionally with 'completion'), 'text' (str), "
    "'messages' ([{role, content}], roles system/user/assistant) or 'conversations' ([{from, value}], "
    "from human/gpt/system)"
)


def _jsonl_turns(rec: Any) -> list[Turn] | None:
    if not isinstance(rec, dict):
        return None
    # Base-model records (chat_template=none): a completion is the assistant's answer to its prompt; plain text is
    # all completion, after an empty prompt.
    if isinstance(rec.get("prompt"), str) and isinstance(rec.get("completion"), str):
        return [{"role": "user", "content": rec["prompt"]}, {"role": "assistant", "content": rec["completion"]}]
    if isinstance(rec.get("prompt"), str):
        return [{"role": "user", "content": rec["prompt"]}]
    if isinstance(rec.get("text"), str) and rec["text"]:
        return [{"role": "user", "content": ""}, {"role": "assistant", "content": rec["text"]}]
    if isinstance(rec.get("messages"), list):
        turns = []
        for msg in rec["messages"]:
            if not (isinstance(msg, dict) and msg.get("role") in ROLES and isinstance(msg.get("content"), str)):
                return None
            turns.append({"role": msg["role"], "content": msg["content"]})
        return turns if any(t["role"] == "user" for t in turns) else None
    if "conversations" in rec:
        return _sharegpt_turns(rec["conversations"])
    return None


def iter_jsonl(path: str | Path) -> Iterator[Conversation]:
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"jsonl source {path} does not exist")
    found = 0
    with open(path, "rb") as handle:
        for lineno, raw in enumerate(handle, start=1):
            try:
                if b"\0" in raw:
                    raise UnicodeDecodeError("utf-8", raw, raw.index(b"\0"), raw.index(b"\0") + 1, "NUL byte")
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise UserError(
                    f"{path}:{lineno}: not UTF-8 text ({err.reason} at byte {err.start}): is it a "
                    f"binary file? {JSONL_EXPECTED}"
                ) from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{path}:{lineno}: invalid JSON ({err.msg}); {JSONL_EXPECTED}") from None
            if lineno == 1 and isinstance(rec, dict) and set(rec) == {JSONL_HEADER_KEY}:
                continue  # data_prep.regenerate's settings line
            turns = _jsonl_turns(rec)
            if turns is None:
                raise UserError(f"{path}:{lineno}: {JSONL_EXPECTED}")
            found += 1
            yield Conversation(id=str(rec.get("id", f"{path.name}:{lineno}")), turns=turns, source=f"jsonl:{path}")
    if not found:
        raise UserError(f"jsonl source {path} holds no conversations (empty file); {JSONL_EXPECTED}")


def load_prompts(
    source: str, n: int | None = None, seed: int = 0, split: str = "all", eval_fraction: float = DEFAULT_EVAL_FRACTION
) -> list[Conversation]:
    """The first ``n`` conversations of ``source`` (all if None) that fall in ``split`` (all/train/eval).

    Sources: mt_bench, humaneval, sharegpt, gsm_symbolic (``n`` defaults to 1000, ``seed`` selects the
    items), jsonl:PATH. Sources are streamed, so a small ``n`` stops reading ShareGPT early.
    """
    if split not in ("all", "train", "eval"):
        raise UserError(f"split must be one of all, train, eval; got '{split}'")
    if not 0.0 <= eval_fraction <= 1.0:
        raise UserError(f"eval_fraction must be in [0, 1]; got {eval_fraction}")
    if n is not None and n < 0:
        raise UserError(f"n must be >= 0; got {n}")

    items: Iterable[Conversation]
    if source == "mt_bench":
        items = iter_mt_bench()
    elif source == "humaneval":
        items = iter_humaneval()
    elif source == "sharegpt":
        items = iter_sharegpt()
    elif source in ("gsm_symbolic", "gsm_symbolic_train"):
        want = GSM_DEFAULT_N if n is None else n
        # Generation is lazy and per-item, so over-provision the size when a split filter discards items.
        frac = {"all": 1.0, "train": 1.0 - eval_fraction, "eval": eval_fraction}[split]
        if want and frac == 0.0:
            return []
        size = want if split == "all" else math.ceil(want / frac * 2) + 100
        items = iter_gsm_symbolic(seed=seed, size=size, train=source == "gsm_symbolic_train")
        n = want
    elif source.startswith("jsonl:") and len(source) > len("jsonl:"):
        items = iter_jsonl(source[len("jsonl:") :])
    else:
        raise UserError(f"unknown prompt source '{source}'; known: {SOURCES}")

    if split != "all":
        items = (c for c in items if split_of(c, eval_fraction) == split)
    return list(itertools.islice(items, n))


# --------------------------------------------------------------------------------------------- templating


def _turns(conversation: Conversation | Sequence[Turn]) -> list[Turn]:
    turns = conversation.turns if isinstance(conversation, Conversation) else conversation
    return [{"role": t["role"], "content": t["content"]} for t in turns]


def _render(tokenizer, turns: list[Turn], generation_prompt: bool, template_kwargs: dict) -> str:
    return tokenizer.apply_chat_template(
        turns, tokenize=False, add_generation_prompt=generation_prompt, **template_kwargs
    )


def render_prompt(
    tokenizer, conversation_prefix: Conversation | Sequence[Turn], template_kwargs: dict | None = None
) -> list[int]:
    """Token ids of the prefix rendered for generation (``add_generation_prompt=True``)."""
    text = _render(tokenizer, _turns(conversation_prefix), True, template_kwargs or {})
    # The template already emits any BOS it wants; add_special_tokens=False avoids a double BOS, matching
    # apply_chat_template(tokenize=True).
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _special_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items() if tok.special)
    return ids


def tokenize_conversation(
    tokenizer,
    conversation: Conversation | Sequence[Turn],
    max_len: int | None = None,
    template_kwargs: dict | None = None,
) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` for training; ids equal ``apply_chat_template(conversation)``.

    ``loss_mask`` is 1 on each assistant turn's content and its end-of-turn token (the last special token the
    template emits for that turn, e.g. SmolLM2's ``<|im_end|>``), and 0 everywhere else: system and user
    turns, the template's default system prompt, the assistant header, and whitespace after end-of-turn.
    An assistant turn's span is ``[len(render(turns[:k], generation prompt)), len(render(turns[:k+1])))``;
    both renders must be prefixes of the full render, else the template is not prefix-stable (e.g. it drops
    earlier reasoning) and masking cannot be derived: ValueError.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise UserError("tokenize_conversation needs a fast tokenizer (offset mappings); got a slow one")
    turns = _turns(conversation)
    kwargs = template_kwargs or {}
    full = _render(tokenizer, turns, False, kwargs)

    spans: list[tuple[int, int]] = []
    for k, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        if k == 0:
            raise UserError("conversation starts with an assistant turn: there is no prompt to condition it on")
        before = _render(tokenizer, turns[:k], True, kwargs)
        after = _render(tokenizer, turns[: k + 1], False, kwargs)
        for label, prefix in (("up to the header of", before), ("through", after)):
            if not full.startswith(prefix):
                raise UserError(
                    f"chat template is not prefix-stable: rendering {label} assistant turn {k} is "
                    "not a prefix of the full conversation (does it rewrite earlier turns, e.g. "
                    "drop reasoning?); cannot derive a loss mask"
                )
        spans.append((len(before), len(after)))

    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    offsets = enc["offset_mapping"]
    starts = [s for s, _ in offsets]
    special = _special_ids(tokenizer)
    mask = [0] * len(ids)
    for start, end in spans:
        # A token belongs to the turn if it starts inside the span; a rare token straddling the header/content
        # boundary counts as prompt.
        members = list(range(bisect.bisect_left(starts, start), bisect.bisect_left(starts, end)))
        # Drop template whitespace after the end-of-turn token (e.g. the "\n" after <|im_end|>): the model
        # stops at end-of-turn, so it is never generated.
        last_special = max((j for j, i in enumerate(members) if ids[i] in special), default=None)
        if last_special is not None:
            tail = members[last_special + 1 :]
            if all(not full[offsets[i][0] : offsets[i][1]].strip() for i in tail):
                members = members[: last_special + 1]
        for i in members:
            mask[i] = 1
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    return ids, mask
