"""FP8 feature storage: the e4m3 codec's error bound, the stored dataset against fp32 values, the manifest, old
manifests, resume, refusals, and a short fit on fp8 features."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from eagle3_training_builders import eagle3_fit_setup
from tiny_targets import save_tiny_target, write_jsonl

from data_prep.datamodules import OnlineFeatureDataModule
from data_prep.extract import bytes_per_token, extract, main, parse_args
from data_prep.features import FeatureDataset
from data_prep.fp8 import FP8, FP8_MAX, dequantize, quantize
from data_prep.manifest import read_manifest
from inference.drafters import load_lm
from spectrain import fit as fit_cli

# Before fp8: the header blocks and column-spec keys of every feature manifest (bf16 datasets keep them exactly).
OLD_HEADER = {
    "format",
    "format_version",
    "kind",
    "spectrain_version",
    "args",
    "target",
    "tokenizer",
    "columns",
    "layers",
    "compute",
}


def test_codec_error_bound_power_of_two_scales_and_exact_bf16_readback():
    """Three blocks a row whose magnitudes differ by orders (as layers 1, 14, 26 do), one outlier channel, and an
    all-zero row: every value within e4m3's bound, scales powers of two that put each block's peak in (224, 448],
    and the bf16 read-back equal to the fp32 one."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 40, generator=generator) * torch.tensor([0.05, 3.0, 200.0])[None, :, None]
    x[:, 1, 7] *= 300.0  # a massive-activation channel
    x[5] = 0.0
    x = x.reshape(64, 120)
    codes, scales = quantize(x, blocks=3)
    assert codes.dtype == FP8 and codes.shape == x.shape and scales.shape == (64, 3)
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))  # powers of two
    peaks = x.abs().reshape(64, 3, 40).amax(-1)
    live = peaks > 0
    assert ((peaks / scales)[live] <= FP8_MAX).all() and ((peaks / scales)[live] > FP8_MAX / 2).all()
    back = dequantize(codes, scales, torch.float32)
    assert torch.equal(dequantize(codes, scales, torch.bfloat16).float(), back)  # exact in bf16
    error = (back - x).abs().reshape(64, 3, 40)
    normal = x.abs().reshape(64, 3, 40) >= scales[..., None] * 2.0**-6  # e4m3's normal range
    assert (error[normal] <= x.abs().reshape(64, 3, 40)[normal] * 2.0**-4).all()
    assert (error <= (scales[..., None] * 2.0**-10).expand_as(error))[~normal].all()
    assert not back[5].any()
    assert (back - x).norm() / x.norm() < 0.04
    with pytest.raises(ValueError, match="does not split into 7 equal blocks"):
        quantize(x, blocks=7)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """The same 10 chats extracted by one preloaded tiny target in fp32 and in fp8, two samples a shard."""
    root = tmp_path_factory.mktemp("fp8")
    target_dir = save_tiny_target(root / "target")
    chats = write_jsonl(root / "chats.jsonl", 10, prompt_only_every=4)
    target = load_lm(str(target_dir), device="cpu", max_seq_len=49, max_batch_size=2)
    args = [
        f"target={target_dir}",
        f"source=jsonl:{chats}",
        "n_samples=10",
        "max_len=48",
        "layers=eagle3",
        "batch_size=2",
        "shard_size=2",
        "device=cpu",
    ]
    for dtype in ("fp32", "fp8"):
        extract(parse_args([*args, f"dtype={dtype}", f"out={root / dtype}"]), target=target)
    return {"root": root, "args": args, "target_dir": target_dir, "target": target}


def rows(directory: Path) -> list[dict[str, torch.Tensor]]:
    dataset = FeatureDataset(directory)
    return [dataset[i] for i in range(len(dataset))]


def test_fp8_dataset_reads_as_bf16_within_the_bound_of_the_fp32_values(datasets):
    root = datasets["root"]
    manifest = read_manifest(root / "fp8")
    assert manifest["args"]["dtype"] == "fp8" and manifest["feature_storage"] == {
        "dtype": "float8_e4m3fn",
        "scaling": "power of two per token and per layer block",
        "scale_dtype": "float32",
        "reads_as": "bfloat16",
    }
    columns = manifest["columns"]
    assert columns["aux_hidden"]["dtype"] == columns["last_hidden"]["dtype"] == "float8_e4m3fn"
    assert columns["aux_hidden"]["scale"] == "aux_hidden_scale" and columns["aux_hidden_scale"]["shape"] == ["T", 3]
    assert columns["last_hidden"]["scale"] == "last_hidden_scale" and columns["last_hidden_scale"]["shape"] == ["T", 1]
    assert bytes_per_token(columns) == 4 * 32 + 4 * 4 + 4 + 1 + 4 * 4  # codes, scales, ids, mask, offsets

    exact, stored = rows(root / "fp32"), rows(root / "fp8")
    assert len(exact) == len(stored) == 8  # 10 chats, 2 prompt-only
    for full, fp8 in zip(exact, stored):
        assert fp8.keys() == full.keys() == {"input_ids", "loss_mask", "aux_hidden", "last_hidden"}
        assert torch.equal(fp8["input_ids"], full["input_ids"]) and torch.equal(fp8["loss_mask"], full["loss_mask"])
        for name, blocks in (("aux_hidden", 3), ("last_hidden", 1)):
            assert fp8[name].dtype == torch.bfloat16 and fp8[name].shape == full[name].shape
            # exactly the codec applied to the fp32 values (one rounding: the runner's fp32 to e4m3)
            assert torch.equal(fp8[name], dequantize(*quantize(full[name], blocks), torch.bfloat16)), name
            assert (fp8[name].float() - full[name]).norm() / full[name].norm() < 0.04, name
    sizes = {d: sum(s["bytes"] for s in read_manifest(root / d)["shards"]) for d in ("fp32", "fp8")}
    assert sizes["fp8"] < 0.4 * sizes["fp32"]  # 165 of 525 bytes a token, plus each shard's Arrow overhead


def test_a_dataset_without_the_field_reads_and_resumes_as_before(datasets, capsys):
    """fp32/bf16 datasets are written as before fp8 existed (no feature_storage, column specs without scale), so
    a dataset made then reads and resumes unchanged."""
    root = datasets["root"]
    manifest = read_manifest(root / "fp32")
    assert (
        set(manifest) - {"shards", "next_source_index", "num_rows", "num_tokens", "skipped", "complete"} == OLD_HEADER
    )
    assert all(set(spec) == {"dtype", "shape", "meaning"} for spec in manifest["columns"].values())
    assert rows(root / "fp32")[0]["aux_hidden"].dtype == torch.float32
    capsys.readouterr()
    extract(parse_args([*datasets["args"], "dtype=fp32", f"out={root / 'fp32'}"]), target=datasets["target"])
    assert "already complete" in capsys.readouterr().err


def test_resume_keeps_fp8_and_another_dtype_is_refused_in_one_line(datasets, tmp_path, capsys):
    """A kill's leftovers (an unlisted shard, a shorter log) are dropped and the same fp8 command ends with the
    uninterrupted dataset; a run with dtype=bf16 (or a bad dtype) into it is one line, before any model loads."""
    out = tmp_path / "fp8"
    args = [*datasets["args"], "dtype=fp8", f"out={out}"]
    extract(parse_args(args), target=datasets["target"])
    reference = rows(out)
    manifest = read_manifest(out)
    (out / "shards" / "shard-00009").mkdir()
    manifest["shards"] = manifest["shards"][:2]
    manifest.update(
        next_source_index=manifest["shards"][-1]["end_source_index"],
        complete=False,
        num_rows=4,
        num_tokens=sum(s["num_tokens"] for s in manifest["shards"]),
        skipped=sum(s["skipped"] for s in manifest["shards"]),
    )
    (out / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    extract(parse_args(args), target=datasets["target"])
    assert "resuming" in capsys.readouterr().err
    resumed = read_manifest(out)
    assert resumed["complete"] and resumed["args"]["dtype"] == "fp8" and "feature_storage" in resumed
    assert all(torch.equal(a[k], b[k]) for a, b in zip(rows(out), reference) for k in a)

    for bad, line in (
        ("dtype=bf16", f"{out} stores dtype=fp8 features; dtype=bf16 would mix two storage dtypes"),
        ("dtype=fp4", "dtype=fp4 is not a feature storage dtype; use one of bf16, fp16, fp32, fp8"),
    ):
        capsys.readouterr()
        assert main([a if not a.startswith("dtype=") else bad for a in args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and line in err, err


def test_online_features_refuse_fp8_in_one_line(datasets):
    with pytest.raises(ValueError, match="data.dtype=fp8 stores extracted features") as info:
        OnlineFeatureDataModule(str(datasets["target_dir"]), source="sharegpt", n_samples=2, max_len=32, dtype="fp8")
    assert "\n" not in str(info.value)


def test_eagle3_trains_on_fp8_features(tmp_path):
    """Two steps of the EAGLE-3 recipe on an fp8 dataset (training and validation sets): it trains and validates."""
    recipes, args, target = eagle3_fit_setup(tmp_path, samples=8, steps=2, every=2, warmup=0)
    source = next(a for a in args if a.startswith("source="))
    feats = tmp_path / "feats"
    assert (
        main(
            [
                f"target={target}",
                source,
                "n_samples=8",
                "max_len=64",
                "layers=[0,1,2]",
                "dtype=fp8",
                "batch_size=4",
                f"out={feats}",
            ]
        )
        == 0
    )
    cfg = fit_cli.compose_recipe([*args, f"dataset_dir={feats}", f"val_dataset_dir={feats}"], directory=recipes)
    result = fit_cli.fit(cfg)
    assert result["trained"] and result["global_step"] == 2
    assert 1.0 <= result["metrics"]["val/tau_sim"] <= 1.0 + cfg.model.gamma
