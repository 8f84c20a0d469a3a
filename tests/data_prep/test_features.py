"""Loading features: memory-mapped dataset, identity refusals, corrupt shards by name, offline == online batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_targets import save_tiny_target, write_jsonl

from data_prep.datamodules import FeatureDataModule, OnlineFeatureDataModule, length_buckets
from data_prep.extract import extract, parse_args
from data_prep.features import FeatureDataset, check_features, collate_features
from data_prep.manifest import DatasetError
from inference.drafters import load_lm


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target, a chat file, and a bf16 eagle3 dataset extracted with batch_size 4."""
    root = tmp_path_factory.mktemp("features")
    target_dir = save_tiny_target(root / "target")
    chats = write_jsonl(root / "chats.jsonl", 14, prompt_only_every=5)
    target = load_lm(str(target_dir), device="cpu", max_seq_len=97, max_batch_size=4)
    extract(
        parse_args(
            [
                f"target={target_dir}",
                f"source=jsonl:{chats}",
                "n_samples=14",
                "max_len=96",
                "layers=eagle3",
                "dtype=bf16",
                "batch_size=4",
                "shard_size=4",
                f"out={root / 'feats'}",
            ]
        ),
        target=target,
    )
    return {"root": root, "target_dir": target_dir, "chats": chats, "target": target, "feats": root / "feats"}


def test_offline_and_online_batches_are_identical(setup, capsys):
    offline = FeatureDataModule(
        setup["feats"],
        batch_size=4,
        shuffle=False,
        target=str(setup["target_dir"]),
        layers="eagle3",
        tokenizer=setup["target"].tokenizer,
        dtype="bf16",
    )
    online = OnlineFeatureDataModule(
        setup["target"],
        source=f"jsonl:{setup['chats']}",
        n_samples=14,
        max_len=96,
        layers="eagle3",
        dtype="bf16",
        batch_size=4,
        shuffle=False,
    )
    offline_batches, online_batches = list(offline.train_dataloader()), list(online.train_dataloader())
    assert len(offline_batches) == len(online_batches) == 3  # 12 samples (2 prompt-only skipped)
    assert "12 of 14 conversations have answer tokens within their max_len=96 window" in capsys.readouterr().err
    for a, b in zip(offline_batches, online_batches):
        assert a.keys() == b.keys() == {"input_ids", "loss_mask", "attention_mask", "aux_hidden", "last_hidden"}
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    batch = offline_batches[0]
    assert batch["aux_hidden"].shape[-1] == 3 * 32 and batch["last_hidden"].dtype == torch.bfloat16
    pad = batch["attention_mask"] == 0
    assert pad.any() and not batch["aux_hidden"][pad].any() and not batch["loss_mask"][pad].any()
    assert (
        batch["attention_mask"].sum(1) == torch.tensor([len(offline.train_set[i]["input_ids"]) for i in range(4)])
    ).all()


def test_length_buckets_group_similar_lengths_and_keep_every_sample():
    lengths = [int(x) for x in torch.randint(5, 500, (203,), generator=torch.Generator().manual_seed(1))]
    batches = length_buckets(lengths, batch_size=4, seed=0, window=10)
    assert sorted(i for b in batches for i in b) == list(range(203)) and all(1 <= len(b) <= 4 for b in batches)
    assert length_buckets(lengths, 4, 0, 10) == batches and length_buckets(lengths, 4, 1, 10) != batches

    def padded(groups):
        return sum(len(b) * max(lengths[i] for i in b) for b in groups)

    random_batches = [list(range(k, min(k + 4, 203))) for k in range(0, 203, 4)]
    assert padded(batches) < 0.8 * padded(random_batches)  # far less padding than batches in source order


def test_bucketed_online_batches_hold_every_sample_once(setup):
    common = dict(
        source=f"jsonl:{setup['chats']}",
        n_samples=14,
        max_len=96,
        layers="eagle3",
        dtype="bf16",
        batch_size=4,
        features=False,
    )
    plain = OnlineFeatureDataModule(setup["target"], **common)
    bucketed = OnlineFeatureDataModule(setup["target"], bucket_by_length=True, **common)
    rows = [list(plain.train_dataloader()), list(bucketed.train_dataloader())]
    for batches in rows:
        assert batches[0].keys() == {"input_ids", "loss_mask", "attention_mask"}  # features=False: no target forward

    def sequences(batches):
        return sorted(
            tuple(b["input_ids"][r, : int(b["attention_mask"][r].sum())].tolist())
            for b in batches
            for r in range(len(b["input_ids"]))
        )

    assert sequences(rows[0]) == sequences(rows[1]) and len(sequences(rows[0])) == 12
    pads = [sum(int((b["attention_mask"] == 0).sum()) for b in batches) for batches in rows]
    assert pads[1] <= pads[0]


def test_collate_pads_right_with_zeros():
    samples = [
        {"input_ids": torch.tensor([5, 6, 7]), "h": torch.ones(3, 2)},
        {"input_ids": torch.tensor([8]), "h": torch.full((1, 2), 2.0)},
    ]
    batch = collate_features(samples)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["h"][1].tolist() == [[2.0, 2.0], [0.0, 0.0], [0.0, 0.0]]


def test_mismatched_recipe_is_refused_in_one_line(setup, tmp_path):
    feats = setup["feats"]
    other = save_tiny_target(tmp_path / "other", seed=7)
    cases = {
        "re-extract with target=": dict(target=str(other)),
        "re-extract with layers=last4": dict(layers="last4"),
        "re-extract with dtype=fp16": dict(dtype="fp16"),
        "re-extract with max_len=2048": dict(max_len=2048),
    }
    for message, expect in cases.items():
        with pytest.raises(DatasetError, match=message) as info:
            FeatureDataset(feats, **expect)
        assert "\n" not in str(info.value)
    tokenizer = setup["target"].tokenizer
    original = tokenizer.chat_template
    try:
        tokenizer.chat_template = original + "{# changed #}"
        with pytest.raises(DatasetError, match="another chat template"):
            check_features(feats, tokenizer=tokenizer)
    finally:
        tokenizer.chat_template = original
    check_features(feats, target=str(setup["target_dir"]), layers=[1, 3, 4], tokenizer=tokenizer, max_len=64)

    manifest = json.loads((feats / "manifest.json").read_text())
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    (incomplete / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    with pytest.raises(DatasetError, match="incomplete"):
        check_features(incomplete)
    with pytest.raises(DatasetError, match="no manifest.json"):
        FeatureDataset(tmp_path)


def copy_dataset(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("damage", ["truncate", "garbage", "flip", "delete"])
def test_damaged_shard_is_reported_by_name(setup, tmp_path, damage):
    feats = copy_dataset(setup["feats"], tmp_path / "feats")
    shard = feats / "shards" / "shard-00001" / "data.arrow"
    data = shard.read_bytes()
    checksums = damage == "flip"  # the size check alone must catch the others
    if damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
        expected = "shard shard-00001 .* is truncated"
    elif damage == "garbage":  # same size, not Arrow: the reader fails, and says which shard
        shard.write_bytes(b"\0" * len(data))
        expected = "shard shard-00001 .* cannot be read"
    elif damage == "flip":  # same size, one flipped byte in the hidden states: only the checksum sees it
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(flipped))
        assert len(FeatureDataset(feats)) == 12
        expected = "shard shard-00001 .* is corrupt"
    else:
        shard.unlink()
        expected = "shard shard-00001 .* is missing"
    with pytest.raises(DatasetError, match=expected) as info:
        FeatureDataset(feats, checksums=checksums)
    assert "\n" not in str(info.value)


def test_feature_dataset_rows_are_views_of_the_shards(setup):
    import pyarrow as pa

    allocated = pa.total_allocated_bytes()
    dataset = FeatureDataset(setup["feats"])
    row = dataset.reader.row(11)
    # Memory-mapped: opening the shards and reading a row copy nothing into Arrow's memory pool.
    assert pa.total_allocated_bytes() == allocated and row["aux_hidden"].base is not None
    assert len(dataset) == 12 and dataset.layer_ids == [1, 3, 4]
    sample = dataset[11]  # the last row of the last shard
    assert sample["aux_hidden"].shape == (len(sample["input_ids"]), 96)
    assert sample["loss_mask"].sum() > 0 and sample["input_ids"].dtype == torch.int64
    with pytest.raises(IndexError):
        dataset[12]


def test_feature_dataset_pickles_as_a_path_for_dataloader_workers(setup):
    import pickle

    dataset = FeatureDataset(setup["feats"])
    blob = pickle.dumps(dataset)
    assert len(blob) < 20_000  # the manifest, not the shards
    clone = pickle.loads(blob)
    assert len(clone) == len(dataset)
    for key, value in dataset[7].items():
        assert torch.equal(clone[7][key], value)


def test_online_window_option_is_refused_for_an_extracted_dataset(setup):
    from omegaconf import OmegaConf

    from spectrain.config import FitConfig
    from spectrain.data import build_feature_datamodule

    cfg = OmegaConf.structured(FitConfig)
    cfg.data.dataset_dir, cfg.data.window = str(setup["feats"]), "answer"
    with pytest.raises(ValueError, match="data.window=answer applies to online features only"):
        build_feature_datamodule(cfg)


def test_online_validation_reads_val_source_whole(setup, tmp_path):
    """A regenerated file written from the train split holds no eval conversations: data.val_source gives
    validation its own file (all of it), and without it the empty split is a one-line error naming the key."""
    from omegaconf import OmegaConf

    from data_prep.samples import load_source
    from spectrain.config import FitConfig
    from spectrain.data import build_feature_datamodule

    train_only = tmp_path / "train_only.jsonl"
    convs = load_source(f"jsonl:{setup['chats']}", 14, split="train")
    train_only.write_text("".join(json.dumps({"id": c.id, "messages": c.turns}) + "\n" for c in convs))
    val = write_jsonl(tmp_path / "val.jsonl", 3)
    cfg = OmegaConf.structured(FitConfig)
    cfg.target, cfg.data.max_len, cfg.data.batch_size, cfg.data.dtype = str(setup["target_dir"]), 96, 4, "fp32"
    cfg.data.source, cfg.data.n_samples, cfg.data.n_val_samples = f"jsonl:{train_only}", 14, 8
    with pytest.raises(ValueError, match=r"split=eval\) gave no conversations.*data.val_source"):
        build_feature_datamodule(cfg).val_dataloader()
    cfg.data.val_source = f"jsonl:{val}"
    batches = list(build_feature_datamodule(cfg).val_dataloader())
    assert sum(b["input_ids"].shape[0] for b in batches) == 3  # every conversation of the file, none of source's
    cfg.data.dataset_dir = str(setup["feats"])
    with pytest.raises(ValueError, match="data.val_source applies to online features only"):
        build_feature_datamodule(cfg)
