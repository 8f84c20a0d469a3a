"""chat_template=auto|none|PATH: base models without a template, plain prompt/completion and text records, a Jinja
file, and the template recorded in datasets and checked where they are used (issue 24, item 2)."""

from __future__ import annotations

import json

import pytest
from extract_helpers import run_extract
from tiny_targets import save_tiny_target

from core.assets import AssetError, chat_template_hash, load_tokenizer
from core.prompts import load_prompts, render_prompt, tokenize_conversation
from data_prep.features import check_features
from data_prep.manifest import DatasetError
from inference import generate

JINJA = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny random target whose tokenizer has no chat template (as a base model's), and plain-text records."""
    root = tmp_path_factory.mktemp("base")
    target = save_tiny_target(root / "target", layers=8)
    tokenizer = load_tokenizer(target)
    tokenizer.chat_template = None
    for leftover in target.glob("chat_template.*"):
        leftover.unlink()
    tokenizer.save_pretrained(target)
    records = [{"prompt": f"Question {i}: what is {i} plus {i}?", "completion": f" It is {2 * i}."} for i in range(6)]
    records += [{"text": f"Plain text number {i}, all of it a completion."} for i in range(4)]
    (root / "plain.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "template.jinja").write_text(JINJA)
    assert not getattr(load_tokenizer(target), "chat_template", None)
    return root


def test_auto_refuses_a_base_tokenizer_in_one_line_naming_none(base, capsys):
    code = generate.main([f"target={base / 'target'}", "prompt=Hello", "max_new_tokens=4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "has no chat template" in err[0] and "chat_template=none" in err[0]


def test_none_generates_from_the_prompt_text_as_is(base, capsys):
    assert (
        generate.main([f"target={base / 'target'}", "chat_template=none", "prompt=Hello there", "max_new_tokens=4"])
        == 0
    )
    tokenizer = load_tokenizer(base / "target", "none")
    # the prompt is the text itself (this tokenizer adds no BOS), with nothing around it
    assert (
        render_prompt(tokenizer, [{"role": "user", "content": "Hello there"}])
        == tokenizer("Hello there", add_special_tokens=False)["input_ids"]
    )


def test_plain_records_train_on_the_completion_and_its_eos(base):
    tokenizer = load_tokenizer(base / "target", "none")
    completion, text = (c.turns for c in load_prompts(f"jsonl:{base / 'plain.jsonl'}")[5:7])
    ids, mask = tokenize_conversation(tokenizer, completion)
    prompt = tokenizer(completion[0]["content"], add_special_tokens=False)["input_ids"]
    assert ids[: len(prompt)] == prompt and mask[: len(prompt)] == [0] * len(prompt)
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == " It is 10." + tokenizer.eos_token
    ids, mask = tokenize_conversation(tokenizer, text)
    assert all(mask) and tokenizer.decode(ids) == text[1]["content"] + tokenizer.eos_token


def test_a_jinja_file_is_used_and_a_missing_one_is_refused(base):
    tokenizer = load_tokenizer(base / "target", str(base / "template.jinja"))
    ids = render_prompt(tokenizer, [{"role": "user", "content": "Hi"}])
    assert tokenizer.decode(ids) == "[user] Hi\n[assistant] "
    with pytest.raises(AssetError, match="chat_template=.*nope.jinja: no such file"):
        load_tokenizer(base / "target", str(base / "nope.jinja"))


def test_extraction_records_the_template_and_a_dataset_is_refused_under_another(base, tmp_path):
    out = tmp_path / "feats"
    manifest = run_extract(
        [
            f"target={base / 'target'}",
            f"source=jsonl:{base / 'plain.jsonl'}",
            "n_samples=10",
            "max_len=64",
            "layers=eagle3",
            "batch_size=4",
            "chat_template=none",
            f"out={out}",
        ]
    )
    assert manifest["complete"] and manifest["num_rows"] == 10 and manifest["args"]["chat_template"] == "none"
    plain = load_tokenizer(base / "target", "none")
    assert manifest["tokenizer"]["chat_template_hash"] == chat_template_hash(plain)
    check_features(out, tokenizer=plain)
    with pytest.raises(DatasetError, match="another chat template"):
        check_features(out, tokenizer=load_tokenizer(base / "target", str(base / "template.jinja")))
