"""Prompt sources, splits and chat-template loss masks (real packaged data, SmolLM2's real template)."""

from __future__ import annotations

import json

import pytest

from core import prompts as P

SHAREGPT_LIMIT = 400


@pytest.fixture(scope="module")
def sharegpt_head() -> list[P.Conversation]:
    return P.load_prompts("sharegpt", n=SHAREGPT_LIMIT)


@pytest.fixture(scope="module")
def tok():
    from core import assets

    return assets.load_tokenizer("smollm2")


# ------------------------------------------------------------------------------------------- sources


def test_mt_bench_has_80_two_turn_questions():
    convs = P.load_prompts("mt_bench")
    assert len(convs) == 80
    assert all(len(c.user_turns) == 2 and len(c.turns) == 2 for c in convs)
    assert len({c.id for c in convs}) == 80
    first = convs[0]
    assert P.prompt_turns(first) == [{"role": "user", "content": first.user_turns[0]}]
    assert P.prompt_turns(first, ["ANSWER"]) == [
        {"role": "user", "content": first.user_turns[0]},
        {"role": "assistant", "content": "ANSWER"},
        {"role": "user", "content": first.user_turns[1]},
    ]
    with pytest.raises(ValueError, match="at most 1"):
        P.prompt_turns(first, ["a", "b"])


def test_humaneval_has_164_problems_with_fenced_prompt():
    convs = P.load_prompts("humaneval")
    assert len(convs) == 164
    msg = convs[0].turns[0]["content"]
    assert msg.startswith(P.HUMANEVAL_INSTRUCTION + "```python\n")
    assert msg.endswith("\n```") and convs[0].meta["prompt"] in msg
    assert convs[0].id == "HumanEval/0"


def test_sharegpt_real_file_prefix(sharegpt_head):
    assert len(sharegpt_head) == SHAREGPT_LIMIT
    assert sharegpt_head[0].id == "QWJhYvA_0"  # file order is kept
    for conv in sharegpt_head:
        roles = [t["role"] for t in conv.turns]
        assert set(roles) <= set(P.ROLES)
        assert next(r for r in roles if r != "system") == "user"  # leading assistant turns are dropped


def _record(i: int, roles=("human", "gpt")) -> dict:
    return {"id": f"r{i}", "conversations": [{"from": r, "value": f"{r} {i}"} for r in roles]}


def test_sharegpt_truncated_synthetic_file(tmp_path):
    n = 7
    text = json.dumps([_record(i) for i in range(n + 1)], indent=2)
    cut = text[: text.rindex('"value"')]  # the last record is cut mid-way, like the packaged file
    path = tmp_path / "truncated.json"
    path.write_text(cut)
    stats: dict[str, int] = {}
    convs = list(P.iter_sharegpt(path, stats))
    assert [c.id for c in convs] == [f"r{i}" for i in range(n)]
    assert stats == {"records": n, "kept": n, "dropped": 0}
    assert convs[0].turns == [{"role": "user", "content": "human 0"}, {"role": "assistant", "content": "gpt 0"}]


def test_sharegpt_role_mapping_and_drops(tmp_path):
    records = [
        _record(0, ("system", "human", "gpt")),
        _record(1, ("human", "bing")),  # unknown role: dropped
        {"id": "r2", "conversations": []},  # empty: dropped
        _record(3, ("gpt", "human", "gpt")),  # continuation: leading gpt dropped
        _record(4, ("gpt",)),  # nothing left: dropped
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(records))  # complete (not truncated) arrays work too
    stats: dict[str, int] = {}
    convs = list(P.iter_sharegpt(path, stats))
    assert [c.id for c in convs] == ["r0", "r3"]
    assert [t["role"] for t in convs[0].turns] == ["system", "user", "assistant"]
    assert [t["content"] for t in convs[1].turns] == ["human 3", "gpt 3"]
    assert stats == {"records": 5, "kept": 2, "dropped": 3}


def test_gsm_symbolic_seeded():
    a = P.load_prompts("gsm_symbolic", n=20, seed=1)
    b = P.load_prompts("gsm_symbolic", n=20, seed=1)
    c = P.load_prompts("gsm_symbolic", n=20, seed=2)
    assert len(a) == 20
    assert [x.turns for x in a] == [x.turns for x in b]
    assert [x.turns for x in a] != [x.turns for x in c]
    assert [t["role"] for t in a[0].turns] == ["user", "assistant"]
    assert a[0].meta["answer"] in a[0].turns[1]["content"]
    # fewer items are a prefix of more items with the same seed
    assert [x.turns for x in P.load_prompts("gsm_symbolic", n=5, seed=1)] == [x.turns for x in a[:5]]


def test_jsonl_formats(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [
        {"prompt": "plain prompt"},
        {
            "id": "m",
            "messages": [
                {"role": "system", "content": "sys"},
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"},
            ],
        },
        {"conversations": [{"from": "human", "value": "h"}, {"from": "gpt", "value": "g"}]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    convs = P.load_prompts(f"jsonl:{path}")
    assert [c.turns for c in convs] == [
        [{"role": "user", "content": "plain prompt"}],
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}],
        [{"role": "user", "content": "h"}, {"role": "assistant", "content": "g"}],
    ]
    assert convs[0].id == "p.jsonl:1" and convs[1].id == "m"
    assert len(P.load_prompts(f"jsonl:{path}", n=2)) == 2


@pytest.mark.parametrize(
    "bad", ['{"completion": "x"}', '{"text": 3}', "not json", '{"messages": [{"role": "bot", "content": "x"}]}']
)
def test_jsonl_bad_line(tmp_path, bad):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n' + bad + "\n")
    with pytest.raises(ValueError) as err:
        P.load_prompts(f"jsonl:{path}")
    msg = str(err.value)
    assert f"{path}:2" in msg and "'prompt'" in msg and "'messages'" in msg and "\n" not in msg


def test_unknown_source():
    with pytest.raises(ValueError) as err:
        P.load_prompts("wikipedia")
    assert P.SOURCES in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="split"):
        P.load_prompts("mt_bench", split="test")


# ------------------------------------------------------------------------------------------- splits


def test_splits_disjoint_and_stable(sharegpt_head):
    train = [c for c in sharegpt_head if P.split_of(c, 0.2) == "train"]
    evals = [c for c in sharegpt_head if P.split_of(c, 0.2) == "eval"]
    assert len(train) + len(evals) == SHAREGPT_LIMIT and 0 < len(evals) < len(train)
    norm = lambda c: " ".join(c.first_user_message.split()).casefold()
    assert not {norm(c) for c in train} & {norm(c) for c in evals}
    # duplicate prompts (modulo whitespace/case) land in the same split
    conv = sharegpt_head[0]
    twin = P.Conversation("twin", [{"role": "user", "content": "  " + conv.first_user_message.upper() + "\n"}], "x")
    assert P.split_of(twin, 0.2) == P.split_of(conv, 0.2)
    # stable across runs and processes (sha256, not the process-salted hash()): a pinned assignment
    assert "".join("e" if P.split_of(c) == "eval" else "t" for c in P.load_prompts("mt_bench")) == PINNED_MT_BENCH


# MT-Bench splits at the default 5% eval fraction, pinned; if this changes, every existing split changes.
PINNED_MT_BENCH = "ttttttttetetttttttttttttttettttttttttttttttttttttttttttttttttttetttetttttttttttt"


def test_load_prompts_split_filter():
    everything = P.load_prompts("humaneval")
    train = P.load_prompts("humaneval", split="train", eval_fraction=0.3)
    evals = P.load_prompts("humaneval", split="eval", eval_fraction=0.3)
    assert len(train) + len(evals) == len(everything)
    assert {c.id for c in train}.isdisjoint({c.id for c in evals})
    assert len(P.load_prompts("humaneval", n=3, split="eval", eval_fraction=0.3)) == 3
    gsm = P.load_prompts("gsm_symbolic", n=10, seed=0, split="eval")
    assert len(gsm) == 10 and all(P.split_of(c) == "eval" for c in gsm)


# ------------------------------------------------------------------------------------------- templating

IM_END = "<|im_end|>"


def _masked_text(tok, ids, mask) -> str:
    return tok.decode([i for i, m in zip(ids, mask) if m])


def _full_ids(tok, turns) -> list[int]:
    # transformers 5 returns a BatchEncoding from tokenize=True
    return list(tok.apply_chat_template(turns, tokenize=True)["input_ids"])


def test_golden_mask_two_turns(tok):
    turns = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "2+2 equals 4."},
        {"role": "user", "content": "And times 3?"},
        {"role": "assistant", "content": "That makes 12.\nDone."},
    ]
    ids, mask = P.tokenize_conversation(tok, turns, max_len=4096)
    assert ids == _full_ids(tok, turns)
    assert len(mask) == len(ids)
    assert _masked_text(tok, ids, mask) == f"2+2 equals 4.{IM_END}That makes 12.\nDone.{IM_END}"
    # contiguous masked runs are exactly the two answers, each closed by <|im_end|>
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    assert runs == [f"2+2 equals 4.{IM_END}", f"That makes 12.\nDone.{IM_END}"]
    unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert "What is 2+2?" in unmasked and "And times 3?" in unmasked
    assert "You are a helpful AI assistant named SmolLM" in unmasked  # default system prompt: unmasked
    assert unmasked.count("<|im_start|>assistant\n") == 2  # headers unmasked


def test_golden_mask_explicit_system(tok):
    conv = P.Conversation(
        "s",
        [
            {"role": "system", "content": "You answer tersely."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
        ],
        "test",
    )
    ids, mask = P.tokenize_conversation(tok, conv, max_len=512)
    assert ids == _full_ids(tok, conv.turns)
    assert _masked_text(tok, ids, mask) == f"Paris.{IM_END}"
    assert "SmolLM" not in tok.decode(ids)  # the explicit system replaces the default one
    assert "You answer tersely." in tok.decode([i for i, m in zip(ids, mask) if not m])


def test_golden_mask_truncated(tok):
    turns = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "one two three four five"}]
    full_ids, full_mask = P.tokenize_conversation(tok, turns)
    start = full_mask.index(1)
    ids, mask = P.tokenize_conversation(tok, turns, max_len=start + 2)
    assert ids == full_ids[: start + 2] and mask == full_mask[: start + 2]
    assert _masked_text(tok, ids, mask) == "one two"


def test_render_prompt_for_generation(tok):
    mt = P.load_prompts("mt_bench", n=1)[0]
    ids = P.render_prompt(tok, P.prompt_turns(mt, ["First answer."]))
    text = tok.decode(ids)
    assert text.endswith("<|im_start|>assistant\n")
    assert "First answer." in text and mt.user_turns[1] in text
    expected = tok.apply_chat_template(P.prompt_turns(mt), tokenize=True, add_generation_prompt=True)
    assert P.render_prompt(tok, P.prompt_turns(mt)) == list(expected["input_ids"])


def test_mask_on_real_sharegpt(tok, sharegpt_head):
    for conv in sharegpt_head[:25]:
        ids, mask = P.tokenize_conversation(tok, conv)
        answers = [t["content"] for t in conv.turns if t["role"] == "assistant"]
        assert _masked_text(tok, ids, mask) == "".join(a + IM_END for a in answers)
        assert ids == _full_ids(tok, conv.turns)


def test_not_prefix_stable_template_is_rejected(tok):
    # A reasoning-style template that drops earlier assistant turns' <think> blocks: turn 1 renders differently
    # once a later turn exists, so no span mapping is valid.
    template = (
        "{% for m in messages %}{% set c = m['content'] %}"
        "{% if m['role'] == 'assistant' and not loop.last %}{% set c = c.split('</think>')[-1] %}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ c }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    turns = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>hmm</think>a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]
    with pytest.raises(ValueError, match="not prefix-stable") as err:
        P.tokenize_conversation(tok, turns, template_kwargs={"chat_template": template})
    assert "\n" not in str(err.value)


def test_answer_window_keeps_conversations_whose_prompt_fills_max_len(tok):
    """window=start drops a conversation whose prompt alone fills max_len; window=answer keeps it, starting
    max_len // 2 tokens before the first answer token; a conversation that fit is the same either way."""
    from data_prep.samples import SampleBuilder

    long = P.Conversation(
        "long",
        [
            {"role": "user", "content": "word " * 120},
            {"role": "assistant", "content": "one two three four five six seven eight"},
        ],
        "t",
    )
    short = P.Conversation(
        "short", [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "one two three"}], "t"
    )
    full_ids, full_mask = P.tokenize_conversation(tok, long)
    first, max_len = full_mask.index(1), 64
    assert first > max_len
    assert SampleBuilder(tok, max_len, window="start")(0, long) is None
    sample = SampleBuilder(tok, max_len, window="answer")(0, long)
    start = first - max_len // 2
    assert (
        sample.input_ids == full_ids[start : start + max_len] and sample.loss_mask == full_mask[start : start + max_len]
    )
    assert sample.loss_mask[: max_len // 2] == [0] * (max_len // 2) and sample.loss_mask[max_len // 2] == 1
    assert _masked_text(tok, sample.input_ids, sample.loss_mask).startswith("one two three")
    kept = SampleBuilder(tok, max_len)(1, short)
    assert kept is not None and SampleBuilder(tok, max_len, window="answer")(1, short) == kept
    with pytest.raises(ValueError, match="window must be one of start, answer, got 'middle'"):
        SampleBuilder(tok, max_len, window="middle")
