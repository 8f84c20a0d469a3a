"""Feature extraction: the stored tensors, the manifest, resume after kill -9, and one-line refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from extract_helpers import run_extract
from tiny_targets import save_tiny_target, write_jsonl

from core.layer_ids import LAYER_CONVENTION, eagle3_layers, resolve_layers
from core.prompts import load_prompts, tokenize_conversation
from data_prep.extract import content_args, extract, main, parse_args
from data_prep.features import FeatureDataset
from data_prep.manifest import read_manifest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("tiny") / "target")


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("data") / "chats.jsonl", 60, prompt_only_every=7)


def rows(directory: Path) -> list[dict[str, torch.Tensor]]:
    dataset = FeatureDataset(directory)
    return [dataset[i] for i in range(len(dataset))]


def assert_same_rows(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for row_a, row_b in zip(a, b):
        assert row_a.keys() == row_b.keys()
        for key in row_a:
            assert torch.equal(row_a[key], row_b[key]), key


def test_layer_specs():
    assert eagle3_layers(30) == [1, 14, 26]  # SmolLM2
    assert resolve_layers("eagle3", 32) == [
        1,
        15,
        28,
    ]  # Llama-3.1-8B: outputs of layers 1, 15, 28 (docs/algorithms/eagle3.md §2)
    assert resolve_layers("last4", 30) == [26, 27, 28]  # + the final-normed state = HF hidden_states[-4:]
    assert resolve_layers([0, 5, -1], 8) == [0, 5, 7]
    for bad, message in (
        (["eagle3", 6], "needs at least 8"),
        (["last9", 8], "K must be in"),
        ([[3, 1], 8], "increasing"),
        ([[8], 8], "not a layer id"),
        (["top3", 8], "eagle3, lastK"),
    ):
        with pytest.raises(ValueError, match=message):
            resolve_layers(*bad)


def test_extract_stores_the_runner_convention(tiny, chats, tmp_path):
    """fp32 storage: aux_hidden blocks are HF hidden_states[i + 1], last_hidden is the final-normed state."""
    from transformers import AutoModelForCausalLM

    from core.assets import load_tokenizer

    out = tmp_path / "feats"
    manifest = run_extract(
        [
            f"target={tiny}",
            f"source=jsonl:{chats}",
            "n_samples=12",
            "max_len=64",
            "layers=eagle3",
            "dtype=fp32",
            "batch_size=4",
            "shard_size=4",
            f"out={out}",
        ]
    )
    assert manifest["complete"] and manifest["layers"] == {
        "spec": "eagle3",
        "ids": [1, 3, 4],
        "convention": LAYER_CONVENTION,
    }
    # 12 chats, one of them prompt-only (index 6): 11 samples, committed 4 + 4 + 3
    assert [s["num_rows"] for s in manifest["shards"]] == [4, 4, 3] and manifest["skipped"] == 1
    assert manifest["num_rows"] == 11 and manifest["next_source_index"] == 12
    assert manifest["num_tokens"] == sum(s["num_tokens"] for s in manifest["shards"])
    for key in ("config_hash", "weights_hash"):
        assert len(manifest["target"][key]) == 16
    assert set(manifest["tokenizer"]) == {"vocab_hash", "vocab_size", "chat_template_hash"}
    assert manifest["args"]["max_len"] == 64 and manifest["args"]["source"] == f"jsonl:{chats}"
    assert manifest["spectrain_version"] and manifest["args"]["seed"] == 0
    assert "window" not in manifest["args"]  # the default: datasets made before the option still resume

    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    tokenizer = load_tokenizer(tiny)
    conversations = [c for i, c in enumerate(load_prompts(f"jsonl:{chats}", n=12)) if i != 6]
    dataset = FeatureDataset(out, target=str(tiny), layers="eagle3", tokenizer=tokenizer, dtype="fp32")
    assert len(dataset) == 11
    for index in (0, 5, 10):
        sample = dataset[index]
        ids, mask = tokenize_conversation(tokenizer, conversations[index], max_len=64)
        assert sample["input_ids"].tolist() == ids and sample["loss_mask"].tolist() == mask
        with torch.no_grad():
            ref = model(torch.tensor([ids]), output_hidden_states=True)
        expected_aux = torch.cat([ref.hidden_states[i + 1][0] for i in (1, 3, 4)], dim=-1)
        torch.testing.assert_close(sample["aux_hidden"], expected_aux, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(sample["last_hidden"], ref.hidden_states[-1][0], atol=1e-5, rtol=1e-4)
        teacher = model.lm_head(sample["last_hidden"])
        torch.testing.assert_close(teacher, ref.logits[0], atol=1e-4, rtol=1e-4)


def test_kill_9_then_rerun_loses_and_duplicates_nothing(tiny, chats, tmp_path, capsys):
    args = [
        f"target={tiny}",
        f"source=jsonl:{chats}",
        "n_samples=60",
        "max_len=48",
        "layers=[1,3]",
        "batch_size=2",
        "shard_size=2",
        "device=cpu",
    ]
    run_extract(args + [f"out={tmp_path / 'reference'}"])

    out = tmp_path / "killed"
    command = [sys.executable, "-m", "data_prep.extract", *args, f"out={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # same thread count as this process: bitwise-equal features
    with open(tmp_path / "log1", "w") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            try:  # kill right after the second shard commit, i.e. while the third shard is being written
                if len(json.loads((out / "manifest.json").read_text())["shards"]) >= 2:
                    break
            except (FileNotFoundError, json.JSONDecodeError):
                pass
            time.sleep(0.005)
        process.send_signal(signal.SIGKILL)
        process.wait()
    interrupted = read_manifest(out)
    assert not interrupted["complete"], "the process finished before the kill; the test did not interrupt it"
    assert 0 < interrupted["next_source_index"] < 60

    capsys.readouterr()
    assert main(args + [f"out={out}"]) == 0  # the same command again (in-process: saves a second startup)
    assert "resuming" in capsys.readouterr().err
    final, reference = read_manifest(out), read_manifest(tmp_path / "reference")
    assert final["complete"] and final["num_rows"] == reference["num_rows"] == 52
    assert [s["end_source_index"] for s in final["shards"]] == [s["end_source_index"] for s in reference["shards"]]
    assert sorted(p.name for p in (out / "shards").iterdir()) == [s["name"] for s in final["shards"]]
    assert_same_rows(rows(out), rows(tmp_path / "reference"))


def test_resume_discards_uncommitted_leftovers_and_refuses_other_arguments(tiny, chats, tmp_path, capsys):
    out = tmp_path / "feats"
    args = [
        f"target={tiny}",
        f"source=jsonl:{chats}",
        "n_samples=10",
        "max_len=32",
        "layers=[0,1]",
        "batch_size=2",
        "shard_size=2",
        f"out={out}",
    ]
    reference = rows_after(args)
    manifest = read_manifest(out)
    # What a kill can leave: a shard renamed into place whose manifest update never happened, and a temp dir.
    (out / "shards" / "shard-00009").mkdir()
    (out / "shards" / ".shard-00010.tmp-x").mkdir()
    manifest["shards"] = manifest["shards"][:2]
    manifest.update(
        next_source_index=manifest["shards"][-1]["end_source_index"],
        complete=False,
        num_rows=4,
        num_tokens=sum(s["num_tokens"] for s in manifest["shards"]),
        skipped=sum(s["skipped"] for s in manifest["shards"]),
    )
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert main(args) == 0
    assert_same_rows(rows(out), reference)
    assert not (out / "shards" / "shard-00009").exists() and not (out / "shards" / ".shard-00010.tmp-x").exists()

    capsys.readouterr()
    assert main([a if not a.startswith("max_len") else "max_len=64" for a in args]) == 2
    err = capsys.readouterr().err.strip()  # refused before any model is loaded: nothing else printed
    assert err.count("\n") == 0 and "args.max_len: 32 != 64" in err and "new out=DIR" in err


def rows_after(args: list[str]) -> list[dict]:
    assert main(args) == 0
    return rows(Path(next(a for a in args if a.startswith("out="))[4:]))


def test_refusals_are_one_line(tiny, chats, tmp_path, capsys, monkeypatch):
    def error_of(argv):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]  # after any model-loading progress bar
        assert err.startswith("error: ")
        return err

    base = [f"target={tiny}", f"source=jsonl:{chats}", "n_samples=4", "max_len=32", "layers=[0,1]"]
    assert "out=DIR is required" in error_of(base)
    assert "did you mean 'layers'" in error_of(base + ["layer=[0]", f"out={tmp_path / 'a'}"])
    assert "dtype=fp4 is not a feature storage dtype" in error_of(base + ["dtype=fp4", f"out={tmp_path / 'a'}"])
    assert "window must be one of start, answer" in error_of(base + ["window=middle", f"out={tmp_path / 'a'}"])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    assert "not empty and has no manifest.json" in error_of(base + [f"out={tmp_path / 'full'}"])

    prompts_only = tmp_path / "prompts.jsonl"
    prompts_only.write_text('{"prompt": "hi"}\n')
    assert "regenerate=true" in error_of(
        [f"target={tiny}", f"source=jsonl:{prompts_only}", "layers=[0]", f"out={tmp_path / 'b'}"]
    )

    monkeypatch.setattr("shutil.disk_usage", lambda path: type("Usage", (), {"free": 1000})())
    err = error_of(base + [f"out={tmp_path / 'c'}"])
    assert "not enough free disk" in err and "is free" in err
    assert not (tmp_path / "c").exists()  # refused before writing anything


def test_answer_window_keeps_long_prompts_and_is_recorded(tiny, chats, tmp_path):
    """Every chat's first answer token lies past max_len=24 (the template's default system prompt is long), so
    window=start would keep none; window=answer keeps each chat that has an answer, 12 prompt tokens then
    answer, and the manifest says which window the dataset holds."""
    base = [f"target={tiny}", f"source=jsonl:{chats}", "n_samples=8", "max_len=24", "layers=[0,1]"]
    answer = run_extract(base + ["window=answer", f"out={tmp_path / 'answer'}"])
    assert answer["args"]["window"] == "answer" and answer["num_rows"] == 7 and answer["skipped"] == 1
    stored = rows(tmp_path / "answer")
    assert all(len(r["input_ids"]) <= 24 and r["loss_mask"][:12].sum() == 0 and r["loss_mask"][12] == 1 for r in stored)


def test_regenerate_answers_with_the_target(tiny, tmp_path):
    from core.prompts import Conversation, render_prompt
    from data_prep.regenerate import Regenerator
    from inference.drafters import eos_token_ids, load_lm

    target = load_lm(str(tiny), device="cpu", max_seq_len=65)
    eos = eos_token_ids(target.tokenizer, target.model.config)
    regen = Regenerator(target.runner, target.tokenizer, eos, max_len=64, max_new_tokens=6)
    conv = Conversation(
        "c",
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "old"},
            {"role": "user", "content": "More?"},
        ],
        "test",
    )
    new = regen(0, conv)
    assert [t["role"] for t in new.turns] == ["user", "assistant", "user", "assistant"]
    assert new.turns[0]["content"] == "Hi" and new.turns[2]["content"] == "More?"
    prompt = render_prompt(target.tokenizer, new.turns[:1])
    with torch.no_grad():
        greedy = target.model.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=0
        )[0, len(prompt) :].tolist()
    greedy = [t for t in greedy if t not in eos]
    assert new.turns[1]["content"] == target.tokenizer.decode(greedy, skip_special_tokens=True) != "old"

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Tell me a story."}\n{"prompt": "Count to three."}\n')
    manifest = extract(
        parse_args(
            [
                f"target={tiny}",
                f"source=jsonl:{prompts}",
                "max_len=64",
                "layers=[0,1]",
                "regenerate=true",
                "max_new_tokens=5",
                "device=cpu",
                "batch_size=1",
                f"out={tmp_path / 'regen'}",
            ]
        ),
        target=target,
    )
    assert manifest["num_rows"] == 2 and manifest["args"]["max_new_tokens"] == 5
    sample = FeatureDataset(tmp_path / "regen")[0]
    assert 1 <= int(sample["loss_mask"].sum()) <= 6  # up to 5 answer tokens + the end-of-turn token


@pytest.mark.real_model
def test_real_smollm2_eagle3_features(smollm2, tmp_path):
    """SmolLM2 (30 layers): layers=eagle3 stores the outputs of layers 1, 14, 26 = HF hidden_states[2, 15, 27]."""
    from inference.drafters import LoadedModel
    from inference.runner_loading import load_runner

    model, tokenizer = smollm2
    target = LoadedModel("smollm2", load_runner(model, max_seq_len=65, max_batch_size=2), tokenizer, model)
    manifest = extract(
        parse_args(
            [
                "target=smollm2",
                "source=sharegpt",
                "n_samples=2",
                "max_len=64",
                "layers=eagle3",
                "dtype=bf16",
                "batch_size=2",
                "device=cpu",
                f"out={tmp_path / 'feats'}",
            ]
        ),
        target=target,
    )
    assert manifest["layers"]["ids"] == [1, 14, 26] and manifest["target"]["num_layers"] == 30
    dataset = FeatureDataset(tmp_path / "feats", target="smollm2", layers="eagle3", tokenizer=tokenizer)
    sample = dataset[0]
    assert sample["aux_hidden"].shape == (len(sample["input_ids"]), 3 * 576) and sample["loss_mask"].any()
    with torch.no_grad():
        ref = model(sample["input_ids"][None], output_hidden_states=True)
    expected = torch.cat([ref.hidden_states[i][0] for i in (2, 15, 27)], dim=-1)
    torch.testing.assert_close(sample["aux_hidden"].float(), expected, atol=0.05, rtol=0.02)  # bf16 storage
    torch.testing.assert_close(sample["last_hidden"].float(), ref.hidden_states[-1][0], atol=0.05, rtol=0.02)


def test_extraction_runs_the_plain_kernels_unless_exact_is_asked(tiny, chats, tmp_path, monkeypatch):
    """Extraction verifies nothing, so the exact kernels (docs/numerics.md) are off unless exact=true (whose features
    are each sample's own whatever its batch: tests/inference/test_moe_target.py); the key joins a dataset's
    arguments only when set, so datasets made before it resume."""
    from data_prep import extract as extract_module

    loaded, load = [], extract_module.load_lm
    monkeypatch.setattr(extract_module, "load_lm", lambda *a, **kw: loaded.append(load(*a, **kw)) or loaded[-1])
    base = [f"target={tiny}", f"source=jsonl:{chats}", "n_samples=3", "max_len=32", "layers=[0,1]", "device=cpu"]
    manifest = run_extract([*base, f"out={tmp_path / 'plain'}"])
    assert [lm.runner.exactness.path for lm in loaded] == ["approximate"] and "exact" not in manifest["args"]
    assert content_args(parse_args([*base, "exact=true", f"out={tmp_path / 'exact'}"]))["exact"] is True
