"""The embedded default: locating packages offline, integrity checks, atomic conversion, real model."""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from core import assets
from core.atomic import atomic_directory, atomic_write_text


def test_unknown_model_name_is_one_line():
    with pytest.raises(assets.AssetError) as info:
        assets.resolve_model_dir("no-such-model")
    assert "unknown model 'no-such-model'" in str(info.value) and "\n" not in str(info.value)


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(assets.AssetError, match="no config.json"):
        assets.resolve_model_dir(tmp_path)


def test_local_hf_directory_resolves(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert assets.resolve_model_dir(str(tmp_path)) == tmp_path


def test_missing_package_names_the_install_command():
    with pytest.raises(assets.AssetError) as info:
        assets.package_dir("spectrain_no_such_pkg", "pip install spectrain-no-such-pkg==1.0")
    assert str(info.value) == (
        "package 'spectrain_no_such_pkg' is not installed; run: pip install spectrain-no-such-pkg==1.0"
    )


def test_packaged_data_files_are_found():
    for name in ("mt_bench", "humaneval", "sharegpt"):
        assert assets.data_file(name).is_file()
    with pytest.raises(assets.AssetError, match="unknown embedded data"):
        assets.data_file("nope")


def test_checksum_mismatch_refuses_to_convert(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTRAIN_CACHE", str(tmp_path))
    tampered = dataclasses.replace(assets.EMBEDDED_MODELS["smollm2"], sha256="0" * 64)
    monkeypatch.setitem(assets.EMBEDDED_MODELS, "smollm2", tampered)
    with pytest.raises(assets.AssetError, match="has sha256 .* expected 000000000000"):
        assets.converted_model_dir("smollm2")
    assert not any((tmp_path / "models").glob("*")) if (tmp_path / "models").exists() else True


def test_concurrent_first_use_converts_once(tmp_path, monkeypatch):
    """Side-by-side pipeline stages on a fresh machine all ask for the model at once: one converts, the others
    wait and find it ready (before, the second rename failed with 'Directory not empty')."""
    monkeypatch.setenv("SPECTRAIN_CACHE", str(tmp_path))
    entry = assets.EMBEDDED_MODELS["smollm2"]
    monkeypatch.setattr(assets, "embedded_gguf", lambda name: tmp_path / "model.gguf")
    monkeypatch.setattr(assets, "sha256_file", lambda path: entry.sha256)
    calls = []

    def slow_convert(entry, gguf_path, out_dir):
        calls.append(out_dir)
        time.sleep(0.3)
        with atomic_directory(out_dir) as tmp:
            (tmp / "spectrain_source.json").write_text("{}")

    monkeypatch.setattr(assets, "_convert_gguf", slow_convert)
    with ThreadPoolExecutor(3) as pool:
        dirs = list(pool.map(lambda _: assets.converted_model_dir("smollm2"), range(3)))
    assert len(calls) == 1
    assert len(set(dirs)) == 1 and (dirs[0] / "spectrain_source.json").is_file()


def test_atomic_directory_leaves_nothing_when_killed_midway(tmp_path):
    final = tmp_path / "model"
    with pytest.raises(RuntimeError), atomic_directory(final) as tmp:
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []
    with atomic_directory(final) as tmp:
        (tmp / "whole.bin").write_bytes(b"y")
    assert [p.name for p in final.iterdir()] == ["whole.bin"]
    atomic_write_text(tmp_path / "a.txt", "hello")
    assert (tmp_path / "a.txt").read_text() == "hello"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "model"]


@pytest.mark.real_model
def test_real_smollm2_greedy_continuation_is_stable(smollm2):
    model, tokenizer = smollm2
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1] :]) == "The capital of France is Paris.<|im_end|>"
    identity = assets.model_identity("smollm2")
    assert identity["model_type"] == "llama" and identity["vocab_size"] == 49152
    assert Path(assets.resolve_model_dir("smollm2"), "model.safetensors").is_file()


def test_each_tokenizer_load_is_a_copy_of_its_own_and_rewritten_files_are_read_again(tmp_path):
    """load_tokenizer caches one load per tokenizer content: a caller that changes its tokenizer (a template, added
    tokens) changes no other caller's, and a directory whose tokenizer is rewritten is loaded again."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def save(vocab: dict[str, int]) -> None:
        backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(tmp_path)

    (tmp_path / "config.json").write_text("{}")
    save({"<unk>": 0, "a": 1, "b": 2})
    first = assets.load_tokenizer(tmp_path)
    before = assets.tokenizer_fingerprint(first)
    first.add_tokens(["c"])
    first.chat_template = "{{ messages }}"
    second = assets.load_tokenizer(tmp_path)
    assert second is not first and len(second) == 3 and not second.chat_template
    assert second("a b c")["input_ids"] == [1, 2, 0]
    second.backend_tokenizer.enable_truncation(max_length=1)  # the backend's own settings are each copy's own
    assert first.backend_tokenizer.truncation is None and first("a b c")["input_ids"] == [1, 2, 3]
    # the fingerprint, kept per loaded files, follows a tokenizer's own vocabulary
    assert assets.tokenizer_fingerprint(second) == before != assets.tokenizer_fingerprint(first)
    assert assets.tokenizer_fingerprint(first) == assets.tokenizer_fingerprint(copy.deepcopy(first))
    save({"<unk>": 0, "b": 1, "a": 2, "c": 3})
    third = assets.load_tokenizer(tmp_path)
    assert third("a b c")["input_ids"] == [2, 1, 3]
    assert assets.tokenizer_fingerprint(third) not in (before, assets.tokenizer_fingerprint(first))


def test_directories_with_the_same_tokenizer_files_share_one_load(tmp_path, monkeypatch):
    """A drafter beside its target (same tokenizer files, another config) costs a copy, not a load; each copy names
    its own directory. A config whose model_type differs (it can pick another tokenizer class) is loaded again."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "shared": 1}, unk_token="<unk>"))  # no other test's files
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    for name, config in (
        ("target", {"hidden_size": 64}),
        ("draft", {"hidden_size": 32}),
        ("other", {"model_type": "x"}),
    ):
        PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(tmp_path / name)
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    loads = []
    real = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda path, **kw: loads.append(path) or real(path, **kw))
    target, draft = assets.load_tokenizer(tmp_path / "target"), assets.load_tokenizer(tmp_path / "draft")
    assert loads == [str(tmp_path / "target")]
    assert (target.name_or_path, draft.name_or_path) == (str(tmp_path / "target"), str(tmp_path / "draft"))
    assert assets.tokenizer_fingerprint(target) == assets.tokenizer_fingerprint(draft)
    assets.load_tokenizer(tmp_path / "other")
    assert loads == [str(tmp_path / "target"), str(tmp_path / "other")]


def test_a_copy_of_smollm2s_tokenizer_is_that_tokenizer():
    """A copy (its backend rebuilt around the loaded vocabulary) serialises, encodes and renders chats exactly as a
    fresh load of the files does, and a token added to one copy is not in another."""
    from transformers import AutoTokenizer

    fresh = AutoTokenizer.from_pretrained(assets.resolve_model_dir("smollm2"))
    one, other = assets.load_tokenizer("smollm2"), assets.load_tokenizer("smollm2")
    assert one.backend_tokenizer.to_str() == fresh.backend_tokenizer.to_str()
    chat = [{"role": "user", "content": "Déjà vu? 12345 <|im_end|> tabs\tand  spaces"}]
    for tokenizer in (one, other):
        assert tokenizer.apply_chat_template(chat, tokenize=False) == fresh.apply_chat_template(chat, tokenize=False)
        text = fresh.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert tokenizer(text)["input_ids"] == fresh(text)["input_ids"]
        assert tokenizer.decode(fresh(text)["input_ids"]) == fresh.decode(fresh(text)["input_ids"])
    one.add_tokens(["<|only_in_one|>"])
    assert len(one) == len(fresh) + 1 and len(other) == len(fresh)
    assert "<|only_in_one|>" not in other.get_vocab()
