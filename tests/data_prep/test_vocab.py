"""Reduced draft vocabulary: top-K assistant tokens, EAGLE-3 d2t offsets / t2d mask, consistency checks, CLI."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_targets import save_tiny_target, write_jsonl

from core.vocab import build_vocab_map, check_vocab_mapping, load_vocab_map
from data_prep.extract import extract, parse_args
from data_prep.features import FeatureDataset
from data_prep.vocab import main


def test_top_k_ids_sorted_ascending_with_offsets():
    counts = np.array([0, 5, 9, 0, 9, 1, 0, 7])
    d2t, t2d = build_vocab_map(counts, 4)
    used = torch.arange(4) + d2t  # draft id j -> target id j + d2t[j]
    assert used.tolist() == [1, 2, 4, 7]  # counts 9, 9, 7, 5: the top four, ascending
    assert t2d.tolist() == [False, True, True, False, True, False, False, True]
    assert d2t.dtype == torch.int64 and d2t.tolist() == [1, 1, 2, 4]
    # ties go to the lower id; ids never seen fill up from the lowest unused id
    assert (torch.arange(2) + build_vocab_map(np.array([3, 0, 3, 3]), 2)[0]).tolist() == [0, 2]
    assert (torch.arange(3) + build_vocab_map(np.array([0, 0, 4, 0]), 3)[0]).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="draft_vocab_size must be in 1..8"):
        build_vocab_map(counts, 9)


def test_consistency_check_refuses_broken_maps():
    d2t, t2d = build_vocab_map(np.array([1, 2, 3, 4, 5]), 3)
    check_vocab_mapping(d2t, t2d)
    shifted = d2t.clone()
    shifted[0] += 1
    with pytest.raises(ValueError, match=r"d2t \+ arange != nonzero\(t2d\)"):
        check_vocab_mapping(shifted, t2d)
    extra = t2d.clone()
    extra[0] = True
    with pytest.raises(ValueError, match="t2d marks 4 tokens but d2t has 3"):
        check_vocab_mapping(d2t, extra)


def test_cli_from_dataset_and_from_source_agree(tmp_path, capsys):
    target = save_tiny_target(tmp_path / "target", layers=2)
    chats = write_jsonl(tmp_path / "chats.jsonl", 10)
    feats = tmp_path / "feats"
    extract(
        parse_args(
            [
                f"target={target}",
                f"source=jsonl:{chats}",
                "n_samples=10",
                "max_len=64",
                "layers=[0,1]",
                "device=cpu",
                f"out={feats}",
            ]
        )
    )
    assert main([f"dataset={feats}", "draft_vocab_size=20", f"out={tmp_path / 'a.safetensors'}"]) == 0
    assert "cover" in capsys.readouterr().err
    assert (
        main(
            [
                f"target={target}",
                f"source=jsonl:{chats}",
                "n_samples=10",
                "max_len=64",
                "draft_vocab_size=20",
                f"out={tmp_path / 'b.safetensors'}",
            ]
        )
        == 0
    )
    d2t, t2d, meta = load_vocab_map(tmp_path / "a.safetensors")
    d2t_b, t2d_b, meta_b = load_vocab_map(tmp_path / "b.safetensors")
    assert torch.equal(d2t, d2t_b) and torch.equal(t2d, t2d_b)
    assert t2d.shape == (49152,) and t2d.dtype == torch.bool and d2t.shape == (20,)

    counts = np.zeros(49152, dtype=np.int64)  # recount by hand: assistant tokens only
    dataset = FeatureDataset(feats)
    for i in range(len(dataset)):
        sample = dataset[i]
        np.add.at(counts, sample["input_ids"][sample["loss_mask"] == 1].numpy(), 1)
    assert int(meta["counted_tokens"]) == counts.sum() == int(meta_b["counted_tokens"])
    assert torch.equal(t2d, build_vocab_map(counts, 20)[1])
    assert float(meta["coverage"]) == pytest.approx(counts[t2d.numpy()].sum() / counts.sum(), abs=1e-6)
    assert meta["format"] == "spectrain.vocab_map" and int(meta["target_vocab_size"]) == 49152


def test_cli_errors_are_one_line(tmp_path, capsys):
    for argv, message in (
        ([f"out={tmp_path / 'x'}"], "exactly one of dataset=DIR or source="),
        (["source=sharegpt", f"out={tmp_path / 'x'}"], "source= needs target="),
        ([f"dataset={tmp_path}", "draft_vocab_size=5", f"out={tmp_path / 'x'}"], "no manifest.json"),
        (["dataset=x", "draft_vocab=5"], "did you mean 'draft_vocab_size'"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err
