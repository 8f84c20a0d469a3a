"""Bad inputs a new user gives the CLIs: each ends in exactly ONE line on stderr (``error: ...``, exit code 2) that
names the problem and the fix, before any work where it can be found early, and leaves nothing behind (issue 24,
item 5; issue 35).

Every case calls the CLI's ``main(argv)`` in-process against tiny random targets and exports built once per
module. ``{B}`` in an argument or a message is the fixtures' directory; the other ``{NAMES}`` in a message are the
lists and identities the code itself prints (``names``), so a message is checked whole without copying them.
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_targets import save_tiny_target, write_jsonl

from spectrain.registry import available_kinds


@pytest.fixture(scope="module")
def B(tmp_path_factory) -> Path:
    """Targets, exports, datasets and broken files the cases point at."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from core.assets import target_record
    from core.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from core.vocab import build_vocab_map, save_vocab_map
    from data_prep import extract
    from spectrain import export
    from spectrain.checkpoint_contract import checkpoint_metadata

    root = tmp_path_factory.mktemp("bad_inputs")
    target, other = save_tiny_target(root / "target"), save_tiny_target(root / "other", seed=1)
    write_jsonl(root / "chats.jsonl", 8)
    (root / "empty.jsonl").write_text("")
    (root / "binary.jsonl").write_bytes(bytes(range(256)) * 8)
    (root / "afile").write_text("a file where a directory is expected\n")
    (root / "notckpt.ckpt").write_text("not a checkpoint\n")

    # an EAGLE-3 export for target, and broken copies of it
    drafter = Eagle3Drafter(
        Eagle3Config.for_target(AutoConfig.from_pretrained(target), draft_vocab_size=64, aux_layer_ids=[1, 3, 4])
    )
    vocab = drafter.config.vocab_size
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:64] = True
    drafter.set_vocab_map(torch.zeros(64, dtype=torch.long), t2d)
    state = {f"drafter.{k}": v for k, v in drafter.state_dict().items()}
    torch.save(
        {"state_dict": state, "global_step": 1, "spectrain": checkpoint_metadata(drafter, target_record(str(target)))},
        root / "e3.ckpt",
    )
    assert export.main([f"ckpt={root / 'e3.ckpt'}", f"out={root / 'e3'}"]) == 0
    weights = (root / "e3" / "model.safetensors").read_bytes()
    for name, data in (
        ("e3trunc", weights[: len(weights) // 2]),
        ("e3rand", np.random.default_rng(0).bytes(len(weights))),
    ):
        shutil.copytree(root / "e3", root / name)
        (root / name / "model.safetensors").write_bytes(data)
    shutil.copytree(root / "e3", root / "e3nan")
    tensors = load_file(root / "e3" / "model.safetensors")
    tensors["fc.weight"] = tensors["fc.weight"].clone()
    tensors["fc.weight"][0, 0] = float("nan")
    save_file(tensors, root / "e3nan" / "model.safetensors")
    shutil.copytree(root / "e3", root / "e3noconf")  # an interrupted copy: weights without config.json
    (root / "e3noconf" / "config.json").unlink()
    shutil.copytree(root / "e3", root / "exports_broken" / "eagle3")  # drafters=DIR holding a torn config.json
    (root / "exports_broken" / "eagle3" / "config.json").write_text((root / "e3" / "config.json").read_text()[:40])
    shutil.copytree(root / "e3", root / "e3kind")  # an export that contradicts itself: EAGLE-3 files, kind specblock
    config = json.loads((root / "e3kind" / "config.json").read_text())
    config["spectrain"]["kind"] = "specblock"
    (root / "e3kind" / "config.json").write_text(json.dumps(config))

    # a draft LM (a plain HF directory) with torn weights
    shutil.copytree(other, root / "lm_trunc")
    lm_weights = (other / "model.safetensors").read_bytes()
    (root / "lm_trunc" / "model.safetensors").write_bytes(lm_weights[: len(lm_weights) // 2])

    # vocabulary maps: of another target's vocabulary size, of another draft size, damaged
    save_vocab_map(root / "vocab_v1000.st", *build_vocab_map(np.arange(1000), 64), {})
    save_vocab_map(root / "vocab_k100.st", *build_vocab_map(np.arange(vocab), 100), {})
    (root / "vocab_trunc.st").write_bytes((root / "vocab_k100.st").read_bytes()[:100])

    # feature datasets of the target (layers [1, 3, 4]) and of the OTHER target
    assert (
        extract.main(
            [
                f"target={target}",
                f"source=jsonl:{root / 'chats.jsonl'}",
                "n_samples=4",
                "max_len=32",
                "dtype=fp32",
                "layers=[1,3,4]",
                f"out={root / 'feats'}",
            ]
        )
        == 0
    )
    assert (
        extract.main(
            [
                f"target={other}",
                f"source=jsonl:{root / 'chats.jsonl'}",
                "n_samples=4",
                "max_len=32",
                "dtype=fp32",
                f"out={root / 'feats_other'}",
            ]
        )
        == 0
    )
    return root


@pytest.fixture(scope="module")
def names(B) -> dict[str, str]:
    """What messages print from the code's own tables, by the placeholder the cases use."""
    from core.assets import model_identity
    from core.prompts import JSONL_EXPECTED, SOURCES
    from data_prep import extract, regenerate, traces, vocab
    from inference.algorithms import ALGORITHMS
    from spectrain import export, fit

    def identity(path: Path) -> str:
        record = model_identity(str(path))
        return f"config {record['config_hash']}, weights {record['weights_hash']}"

    return {
        "JSONL": JSONL_EXPECTED,
        "SOURCES": SOURCES,
        "ALGORITHMS": ", ".join(ALGORITHMS),
        "RECIPES": ", ".join(fit.available_recipes()),
        "RECIPES_DIR": str(fit.recipes_dir()),
        "EXPORT_USAGE": export.USAGE,
        "EXTRACT_USAGE": extract.USAGE,
        "REGENERATE_USAGE": regenerate.USAGE,
        "TRACES_USAGE": traces.USAGE,
        "VOCAB_USAGE": vocab.USAGE,
        "TARGET_ID": identity(B / "target"),
        "OTHER_ID": identity(B / "other"),
    }


def disk_full(monkeypatch, B: Path) -> None:
    """Every safetensors write hits a full disk."""
    import safetensors.torch

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)


_HASHES: dict[tuple, str] = {}  # (path, size, mtime_ns, inode) -> hash of the bytes


def content_hash(path: Path) -> str:
    """The hash of ``path``'s bytes, read again whenever its size, mtime or inode differs from the last read (any
    write changes its mtime), so the table's ~50 MB of fixtures are not re-read for every case."""
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns, stat.st_ino)
    if key not in _HASHES:
        _HASHES[key] = hashlib.sha1(path.read_bytes()).hexdigest()
    return _HASHES[key]


def tree(root: Path) -> dict[str, str]:
    """Every file and directory under ``root``, hidden ones (temporary outputs) included: a file by the hash of its
    bytes, so one rewritten or appended to in place is caught, not only one added or removed."""
    return {str(p.relative_to(root)): content_hash(p) if p.is_file() else "dir" for p in sorted(root.rglob("*"))}


EVAL = (
    "target={B}/target",
    "n_prompts=1",
    "max_new_tokens=2",
    "bench=jsonl:{B}/chats.jsonl",
    "warmup=false",
    "out={B}/eval",
)
GEN = ("target={B}/target", "prompt=hi", "max_new_tokens=2")
EXTRACT = ("target={B}/target", "source=jsonl:{B}/chats.jsonl", "n_samples=2", "max_len=32")
UNDRAFTED = ("target={B}/target", "source=jsonl:{B}/chats.jsonl", "n_samples=1", "max_new_tokens=4")
TRACES = (*UNDRAFTED, "drafter={B}/other")
REGEN = ("target={B}/target", "source=jsonl:{B}/chats.jsonl", "n_samples=2", "max_len=32", "max_new_tokens=2")
SERVE = ("target={B}/target", "port=0", "warmup=false")
FIT = (
    "recipe=eagle3_smollm2",
    "target={B}/target",
    "max_len=32",
    "batch_size=2",
    "max_steps=1",
    "runs_dir={B}/runs",
    "draft_vocab_size=64",
    "layers=[1,3,4]",
    "dtype=fp32",
    "source=jsonl:{B}/chats.jsonl",
    "n_samples=4",
    "n_val_samples=2",
)

# (CLI module, argv, setup before the call, the whole line after "error: ")
CASES = [
    # damaged or unusable exports, wherever a drafter is loaded
    (
        "inference.evaluate",
        (*EVAL, "algorithms=eagle3_tree", "drafter.eagle3={B}/e3trunc"),
        None,
        "{B}/e3trunc/model.safetensors is damaged (truncated or not a safetensors file: Error while deserializing "
        "header: incomplete metadata, file not fully covered); re-export the drafter (python -m spectrain.export)",
    ),
    (
        "inference.evaluate",
        (*EVAL, "algorithms=eagle3_tree", "drafter.eagle3={B}/e3rand"),
        None,
        "{B}/e3rand/model.safetensors is damaged (truncated or not a safetensors file: Error while deserializing "
        "header: header too large); re-export the drafter (python -m spectrain.export)",
    ),
    (
        "inference.evaluate",
        (*EVAL, "algorithms=eagle3_tree", "drafter.eagle3={B}/e3nan"),
        None,
        "{B}/e3nan/model.safetensors holds NaN/inf values (tensor 'fc.weight'): the weights are unusable; "
        "re-export the drafter (python -m spectrain.export)",
    ),
    (
        "inference.evaluate",
        (*EVAL, "algorithms=eagle3_tree", "drafter.eagle3={B}/e3noconf"),
        None,
        "{B}/e3noconf has model.safetensors but no config.json: an interrupted or incomplete copy of an export; "
        "re-export it (python -m spectrain.export)",
    ),
    (
        "inference.evaluate",
        (*EVAL, "algorithms=eagle3_tree", "drafter.eagle3={B}/nowhere"),
        None,
        "drafter '{B}/nowhere' does not exist; give an export directory of python -m spectrain.export",
    ),
    (
        "inference.evaluate",
        (*EVAL, "algorithms=sps", "drafter={B}/lm_trunc"),
        None,
        "the weights of '{B}/lm_trunc' are damaged (truncated or corrupt: {B}/lm_trunc/model.safetensors: Error "
        "while deserializing header: incomplete metadata, file not fully covered); re-export or re-copy the model "
        "directory",
    ),
    (
        "inference.generate",
        (*GEN, "algorithm=eagle3_tree", "drafter={B}/e3trunc"),
        None,
        "{B}/e3trunc/model.safetensors is damaged (truncated or not a safetensors file: Error while deserializing "
        "header: incomplete metadata, file not fully covered); re-export the drafter (python -m spectrain.export)",
    ),
    (
        "spectrain.export",
        ("import={B}/e3trunc", "out={B}/re_trunc"),
        None,
        "{B}/e3trunc/model.safetensors is damaged (truncated or not a safetensors file: Error while deserializing "
        "header: incomplete metadata, file not fully covered); re-export the drafter (python -m spectrain.export)",
    ),
    (
        "spectrain.export",
        ("import={B}/e3nan", "out={B}/re_nan"),
        None,
        "{B}/e3nan/model.safetensors holds NaN/inf values (tensor 'fc.weight'): the weights are unusable; "
        "re-export the drafter (python -m spectrain.export)",
    ),
    (
        "inference.serve.server",
        (*SERVE, "algorithm=eagle3_tree", "drafter.eagle3={B}/e3trunc"),
        None,
        "{B}/e3trunc/model.safetensors is damaged (truncated or not a safetensors file: Error while deserializing "
        "header: incomplete metadata, file not fully covered); re-export the drafter (python -m spectrain.export)",
    ),
    # a drafter whose recorded kind is not the one the algorithm loads (issue 35)
    (
        "inference.evaluate",
        (*EVAL, "algorithms=eagle3_tree", "drafter.eagle3={B}/e3kind"),
        None,
        "{B}/e3kind/config.json records a 'specblock' drafter, not eagle3: EAGLE-3 algorithms cannot load it; "
        "give an eagle3 export of python -m spectrain.export (or use this one with an algorithm for specblock "
        "drafters)",
    ),
    (
        "inference.evaluate",
        (*EVAL, "algorithms=specblock_tree", "drafter.specblock={B}/e3"),
        None,
        "{B}/e3/config.json records a 'eagle3' drafter, not specblock: SpecBlock algorithms cannot load it; give "
        "a specblock export of python -m spectrain.export (or use this one with an algorithm for eagle3 drafters)",
    ),
    (
        "inference.evaluate",
        (*EVAL, "algorithms=specblock_tree", "drafter.specblock={B}/e3kind"),
        None,
        "{B}/e3kind/config.json records a specblock drafter, but its architecture is not a SpecBlock's (unknown "
        "specblock config fields ['norm_before_residual', 'own_embedding']); re-export the drafter (python -m "
        "spectrain.export)",
    ),
    (
        "inference.serve.server",
        (*SERVE, "algorithm=eagle3_tree", "drafter.eagle3={B}/e3kind"),
        None,
        "{B}/e3kind/config.json records a 'specblock' drafter, not eagle3: EAGLE-3 algorithms cannot load it; "
        "give an eagle3 export of python -m spectrain.export (or use this one with an algorithm for specblock "
        "drafters)",
    ),
    (
        "inference.serve.server",
        (*SERVE, "algorithm=specblock_tree", "drafter.specblock={B}/e3"),
        None,
        "{B}/e3/config.json records a 'eagle3' drafter, not specblock: SpecBlock algorithms cannot load it; give "
        "a specblock export of python -m spectrain.export (or use this one with an algorithm for eagle3 drafters)",
    ),
    # drafter= is routed by the kind its export records: another kind's export is named as such
    (
        "inference.evaluate",
        (*EVAL, "algorithms=specblock_tree", "drafter={B}/e3"),
        None,
        "'specblock_tree' needs a SpecBlock export of python -m spectrain.export for this target, but "
        "drafter={B}/e3 is a eagle3 export (its config.json says so); give drafter.specblock=PATH or choose an "
        "algorithm for it",
    ),
    (
        "inference.generate",
        (*GEN, "algorithm=sps", "drafter={B}/e3"),
        None,
        "'sps' needs a draft LM (an exported draft_lm or a HF directory sharing the target's tokenizer), but "
        "drafter={B}/e3 is a eagle3 export (its config.json says so); give drafter=PATH or choose an algorithm "
        "for it",
    ),
    (
        "inference.serve.server",
        (*SERVE, "algorithm=specblock_tree", "drafter={B}/e3"),
        None,
        "'specblock_tree' needs a SpecBlock export of python -m spectrain.export for this target, but "
        "drafter={B}/e3 is a eagle3 export (its config.json says so); give drafter.specblock=PATH or choose an "
        "algorithm for it",
    ),
    (
        "spectrain.export",
        ("import={B}/e3kind", "out={B}/y"),
        None,
        "{B}/e3kind/config.json records a 'specblock' drafter, not eagle3: EAGLE-3 algorithms cannot load it; "
        "give an eagle3 export of python -m spectrain.export (or use this one with an algorithm for specblock "
        "drafters)",
    ),
    (
        "data_prep.traces",
        (*UNDRAFTED, "drafter={B}/e3", "out={B}/t"),
        None,
        "drafter '{B}/e3' is an export of kind eagle3, not a draft LM: give a draft_lm export or a causal-LM "
        "directory (or use this one with an algorithm for eagle3 drafters)",
    ),
    # outputs that cannot be written fail before any model loads
    (
        "inference.evaluate",
        (*EVAL[:-1], "out={B}/afile"),
        None,
        "out={B}/afile is an existing file, not a directory; choose a directory path (or remove the file)",
    ),
    (
        "inference.evaluate",
        (*EVAL[:-1], "out={B}/afile/sub"),
        None,
        "out={B}/afile/sub cannot be created: {B}/afile is a file, not a directory; choose another out=",
    ),
    (
        "data_prep.extract",
        (*EXTRACT, "out={B}/afile"),
        None,
        "out={B}/afile is an existing file, not a directory; choose a directory path (or remove the file)",
    ),
    (
        "data_prep.traces",
        (*TRACES, "out={B}/afile/sub"),
        None,
        "out={B}/afile/sub cannot be created: {B}/afile is a file, not a directory; choose another out=",
    ),
    (
        "data_prep.vocab",
        ("dataset={B}/feats_other", "draft_vocab_size=8", "out={B}/e3"),
        None,
        "out={B}/e3 is a directory; give a file path such as {B}/e3/NAME",
    ),
    (
        "data_prep.vocab",
        ("dataset={B}/feats_other", "draft_vocab_size=8", "out={B}/afile/map.st"),
        None,
        "out={B}/afile/map.st cannot be created: {B}/afile is a file, not a directory; choose another out=",
    ),
    (
        "data_prep.ngram_corpus",
        ("target={B}/target", "source=jsonl:{B}/chats.jsonl", "out={B}/afile/c.json"),
        None,
        "out={B}/afile/c.json cannot be created: {B}/afile is a file, not a directory; choose another out=",
    ),
    (
        "data_prep.regenerate",
        ("target={B}/target", "source=jsonl:{B}/chats.jsonl", "out={B}/afile/r.jsonl"),
        None,
        "{B}/afile is a file where a directory is needed; choose another path",
    ),
    (
        "spectrain.export",
        ("ckpt={B}/e3.ckpt", "out={B}/afile"),
        None,
        "out={B}/afile is an existing file, not a directory; choose a directory path (or remove the file)",
    ),
    (
        "spectrain.demo",
        ("out={B}/afile",),
        None,
        "out={B}/afile is an existing file, not a directory; choose a directory path (or remove the file)",
    ),
    (
        "spectrain.export",
        ("ckpt={B}/e3.ckpt", "out={B}/e3"),
        None,
        "out={B}/e3 already exists; choose a new directory (exports are never overwritten)",
    ),
    (
        "data_prep.regenerate",
        (*EXTRACT, "max_new_tokens=2", "out={B}/e3"),
        None,
        "out={B}/e3 is a directory; give a file path such as {B}/e3/regenerated.jsonl",
    ),
    (
        "data_prep.regenerate",
        (*EXTRACT, "max_new_tokens=2", "out={B}/chats.jsonl"),
        None,
        "{B}/chats.jsonl exists and is not a data_prep.regenerate output; choose another out= or remove it",
    ),
    # a full disk: one line, and no half-written export under the final name
    (
        "spectrain.export",
        ("ckpt={B}/e3.ckpt", "out={B}/full"),
        disk_full,
        "no space left on the device: free disk space (or write elsewhere) and re-run",
    ),
    # prompt sources
    (
        "inference.evaluate",
        (*EVAL, "bench=jsonl:{B}/empty.jsonl"),
        None,
        "jsonl source {B}/empty.jsonl holds no conversations (empty file); {JSONL}",
    ),
    (
        "inference.evaluate",
        (*EVAL, "bench=jsonl:{B}/binary.jsonl"),
        None,
        "{B}/binary.jsonl:1: not UTF-8 text (NUL byte at byte 0): is it a binary file? {JSONL}",
    ),
    (
        "data_prep.extract",
        (*EXTRACT, "source=jsonl:{B}/binary.jsonl", "out={B}/x"),
        None,
        "{B}/binary.jsonl:1: not UTF-8 text (NUL byte at byte 0): is it a binary file? {JSONL}",
    ),
    (
        "data_prep.extract",
        (*EXTRACT, "source=jsonl:{B}/empty.jsonl", "out={B}/x"),
        None,
        "jsonl source {B}/empty.jsonl holds no conversations (empty file); {JSONL}",
    ),
    ("inference.evaluate", (*EVAL, "bench=unknown"), None, "unknown prompt source 'unknown'; known: {SOURCES}"),
    (
        "spectrain.fit",
        (*FIT, "source=jsonl:{B}/empty.jsonl"),
        None,
        "jsonl source {B}/empty.jsonl holds no conversations (empty file); {JSONL}",
    ),
    # values
    ("inference.evaluate", (*EVAL, "n_prompts=0"), None, "n_prompts and batch_size must be >= 1"),
    (
        "inference.evaluate",
        (*EVAL, "temperature=-1"),
        None,
        "temperature must be a finite number >= 0 (0 = greedy), got -1.0",
    ),
    (
        "inference.evaluate",
        (*EVAL, "algorithms=eagle3_tre"),
        None,
        "unknown algorithm 'eagle3_tre'; available: {ALGORITHMS}",
    ),
    (
        "inference.generate",
        (*GEN, "prompt="),
        None,
        "prompt= has no value (Incompatible value 'None' for field of type 'str'); write prompt=VALUE",
    ),
    (
        "inference.generate",
        (*GEN, "algorithm=sps"),
        None,
        "algorithm 'sps' needs a draft LM (an exported draft_lm or a HF directory sharing the target's "
        "tokenizer): add drafter=PATH",
    ),
    (
        "data_prep.extract",
        (*EXTRACT, "dtype=fp4", "out={B}/x"),
        None,
        "dtype=fp4 is not a feature storage dtype; use one of bf16, fp16, fp32, fp8",
    ),
    (
        "data_prep.extract",
        (*EXTRACT, "n_samples=abc", "out={B}/x"),
        None,
        "bad value in n_samples=abc: Value 'abc' of type 'str' could not be converted to Integer",
    ),
    (
        "spectrain.export",
        ("ckpt={B}/e3.ckpt", "format=unknown", "out={B}/y"),
        None,
        "format must be one of native, sglang, speculators, dflash, got 'unknown'",
    ),
    (
        "spectrain.export",
        ("ckpt={B}/e3.ckpt", "dtype=fp8", "out={B}/y"),
        None,
        "dtype must be one of auto, float32, bfloat16, float16, got 'fp8'",
    ),
    (
        "spectrain.export",
        ("ckpt={B}/notckpt.ckpt", "out={B}/y"),
        None,
        "ckpt={B}/notckpt.ckpt is not a readable Lightning checkpoint (UnpicklingError: invalid load key, 'n'.); "
        "give runs/<run>/checkpoints/last.ckpt (or stepN.ckpt) of python -m spectrain.fit, or an export directory",
    ),
    (
        "spectrain.export",
        ("ckpt={B}/e3.ckpt", "speculative_tokens=0", "format=speculators", "out={B}/y"),
        None,
        "speculative_tokens must be >= 1, got 0",
    ),
    ("data_prep.extract", (*EXTRACT, "n_samples=0", "out={B}/x"), None, "n_samples must be >= 1, got 0"),
    (
        "data_prep.extract",
        (*EXTRACT, "window=middle", "out={B}/x"),
        None,
        "window must be one of start, answer, got 'middle'",
    ),
    (
        "data_prep.extract",
        (*EXTRACT, "device=cuda", "out={B}/x"),
        None,
        "device=cuda but CUDA is not available; use device=cpu",
    ),
    (
        "data_prep.regenerate",
        (*EXTRACT, "max_new_tokens=2", "n_samples=0", "out={B}/r.jsonl"),
        None,
        "n_samples must be >= 1, got 0",
    ),
    (
        "data_prep.regenerate",
        (*EXTRACT, "max_new_tokens=2", "temperature=-1", "out={B}/r.jsonl"),
        None,
        "temperature must be a finite number >= 0 (0 = greedy), got -1.0",
    ),
    (
        "data_prep.regenerate",
        (*EXTRACT, "max_new_tokens=2", "dtype=fp16", "out={B}/r.jsonl"),
        None,
        "dtype=fp16 is not supported; use auto, fp32 or bf16",
    ),
    ("data_prep.traces", (*TRACES, "gamma=0", "out={B}/t"), None, "gamma must be >= 1, got 0"),
    (
        "data_prep.vocab",
        ("dataset={B}/feats_other", "draft_vocab_size=0", "out={B}/v.st"),
        None,
        "draft_vocab_size must be in 1..49152 (the target vocabulary), got 0",
    ),
    ("inference.evaluate", (*EVAL, "max_new_tokens=-1"), None, "max_new_tokens=-1 must be >= 1"),
    ("inference.evaluate", (*EVAL, "top_p=2"), None, "top_p must be in (0, 1] (1 = off), got 2.0"),
    (
        "inference.evaluate",
        (*EVAL, "algorithms=ar", "sps.gamma=3"),
        None,
        "sps.gamma is not read by ar (ar reads no algorithm option); it is an option of sps: drop it or choose an "
        "algorithm that reads it",
    ),
    ("inference.generate", (*GEN, "max_new_tokens=-1"), None, "max_new_tokens=-1 must be >= 1"),
    ("inference.generate", (*GEN, "algorithm=nope"), None, "unknown algorithm 'nope'; available: {ALGORITHMS}"),
    (
        "inference.serve.server",
        (*SERVE, "port=70000"),
        None,
        "port=70000 is not a TCP port; use 1-65535 (or 0 for any free port)",
    ),
    (
        "inference.serve.server",
        (*SERVE, "algorithms=[ar,sps]"),
        None,
        "algorithms=[ar,sps]: a server runs one algorithm; write algorithm=NAME and start one server per algorithm",
    ),
    ("inference.serve.server", (*SERVE, "max_queue=0"), None, "max_queue=0 must be >= 1"),
    ("inference.serve.server", (*SERVE, "batch_size=-1"), None, "batch_size=-1 must be >= 0 (0 = auto)"),
    (
        "inference.serve.server",
        (*SERVE, "algorithm=ar", "eagle3_tree.tree_depth=3"),
        None,
        "eagle3_tree.tree_depth is not read by ar (ar reads no algorithm option); it is an option of eagle3_tree: "
        "drop it or choose an algorithm that reads it",
    ),
    # required keys, and keys that exclude each other
    ("spectrain.export", ("ckpt={B}/e3.ckpt",), None, "out=DIR is required; usage: {EXPORT_USAGE}"),
    (
        "spectrain.export",
        ("ckpt={B}/e3.ckpt", "import={B}/e3", "out={B}/y"),
        None,
        "give exactly one of ckpt=PATH or import=PATH; usage: {EXPORT_USAGE}",
    ),
    ("data_prep.extract", (*EXTRACT,), None, "out=DIR is required; usage: {EXTRACT_USAGE}"),
    (
        "data_prep.regenerate",
        (*EXTRACT, "max_new_tokens=2"),
        None,
        "out=FILE.jsonl is required; usage: {REGENERATE_USAGE}",
    ),
    ("data_prep.traces", (*TRACES,), None, "out=DIR is required; usage: {TRACES_USAGE}"),
    (
        "data_prep.traces",
        (*UNDRAFTED, "out={B}/t"),
        None,
        "drafter=PATH is required (a draft LM for this target); usage: {TRACES_USAGE}",
    ),
    (
        "data_prep.vocab",
        ("dataset={B}/feats_other", "draft_vocab_size=8"),
        None,
        "out=FILE is required; usage: {VOCAB_USAGE}",
    ),
    (
        "data_prep.vocab",
        ("dataset={B}/feats_other", "draft_vocab_size=8", "source=sharegpt", "out={B}/v.st"),
        None,
        "give exactly one of dataset=DIR or source=NAME (with target=); usage: {VOCAB_USAGE}",
    ),
    (
        "data_prep.vocab",
        ("source=jsonl:{B}/chats.jsonl", "draft_vocab_size=8", "out={B}/v.st"),
        None,
        "source= needs target= (whose tokenizer and chat template tokenize the prompts)",
    ),
    # models and datasets given in the wrong place, or not there
    (
        "inference.evaluate",
        (*EVAL, "target={B}/e3"),
        None,
        "'{B}/e3' is a spectrain eagle3 export, not a causal LM: pass it as a drafter (drafter=PATH "
        "or drafters=DIR) and give the model it drafts for as target=",
    ),
    (
        "inference.evaluate",
        (*EVAL, "target={B}/nowhere"),
        None,
        "unknown model '{B}/nowhere': use one of ['smollm2'] or a local HF model directory (nothing is downloaded "
        "from a hub)",
    ),
    (
        "spectrain.fit",
        (*FIT, "target={B}/nowhere"),
        None,
        "target={B}/nowhere is not usable: unknown model '{B}/nowhere': use one of ['smollm2'] or a local HF "
        "model directory (nothing is downloaded from a hub); pass target=/path/to/model_dir",
    ),
    (
        "spectrain.fit",
        (*FIT, "dataset_dir={B}/nowhere"),
        None,
        "data.dataset_dir={B}/nowhere has no manifest.json: not a spectrain dataset (create one with python -m "
        "data_prep.extract or data_prep.traces)",
    ),
    (
        "spectrain.export",
        ("ckpt={B}/nowhere.ckpt", "out={B}/y"),
        None,
        "{B}/nowhere.ckpt does not exist; give runs/<run>/checkpoints/last.ckpt of python -m spectrain.fit, or an "
        "export directory",
    ),
    (
        "spectrain.export",
        ("import={B}/nowhere", "out={B}/y"),
        None,
        "{B}/nowhere does not exist; give runs/<run>/checkpoints/last.ckpt of python -m spectrain.fit, or an "
        "export directory",
    ),
    (
        "spectrain.export",
        ("import={B}/e3", "target={B}/other", "out={B}/y"),
        None,
        "{B}/e3 was trained for target '{B}/target', not '{B}/other'; use the target it was trained for",
    ),
    (
        "data_prep.extract",
        (*EXTRACT, "target={B}/e3", "out={B}/x"),
        None,
        "'{B}/e3' is a spectrain eagle3 export, not a causal LM: pass it as a drafter (drafter=PATH "
        "or drafters=DIR) and give the model it drafts for as target=",
    ),
    (
        "data_prep.regenerate",
        (*EXTRACT, "max_new_tokens=2", "target={B}/nowhere", "out={B}/r.jsonl"),
        None,
        "unknown model '{B}/nowhere': use one of ['smollm2'] or a local HF model directory (nothing is downloaded "
        "from a hub)",
    ),
    (
        "data_prep.vocab",
        ("dataset={B}/nowhere", "draft_vocab_size=8", "out={B}/v.st"),
        None,
        "{B}/nowhere has no manifest.json: not a spectrain dataset (create one with python -m data_prep.extract "
        "or data_prep.traces)",
    ),
    (
        "inference.evaluate",
        (*EVAL, "algorithms=eagle3_tree", "drafter.eagle3={B}/e3", "target={B}/other"),
        None,
        "drafter '{B}/e3' was trained for target '{B}/target' ({TARGET_ID}), not '{B}/other' ({OTHER_ID}): use a "
        "drafter trained for this target",
    ),
    (
        "inference.generate",
        (*GEN, "target={B}/nowhere"),
        None,
        "unknown model '{B}/nowhere': use one of ['smollm2'] or a local HF model directory (nothing is downloaded "
        "from a hub)",
    ),
    (
        "inference.serve.server",
        (*SERVE, "target={B}/nowhere"),
        None,
        "unknown model '{B}/nowhere': use one of ['smollm2'] or a local HF model directory (nothing is downloaded "
        "from a hub)",
    ),
    # training: the recipe's values are checked before Lightning sees them (issue 35)
    (
        "spectrain.fit",
        (*FIT, "trainer.max_steps=-5"),
        None,
        "trainer.max_steps=-5 must be >= 1 (the optimizer steps to train)",
    ),
    (
        "spectrain.fit",
        (*FIT, "trainer.devices=0"),
        None,
        "trainer.devices=0 must be auto, a count >= 1, -1 (every device) or a list of device ids such as [0,1]",
    ),
    (
        "spectrain.fit",
        (*FIT, "data.batch_size=0", "dry_run=true"),
        None,
        "data.batch_size=0 must be >= 1 (samples per process and step)",
    ),
    (
        "spectrain.fit",
        (*FIT, "trainer.accelerator=tpu"),
        None,
        "trainer.accelerator=tpu is not one of auto, cpu, gpu, cuda",
    ),
    ("spectrain.fit", (*FIT, "optim.lr=0"), None, "optim.lr=0.0 must be > 0"),
    (
        "spectrain.fit",
        (*FIT, "trainer.limit_val_batches=2"),
        None,
        "trainer.limit_val_batches=2.0 must be between 0.0 and 1.0 (the fraction of validation batches run)",
    ),
    (
        "spectrain.fit",
        (*FIT, "data.max_len=1"),
        None,
        "data.max_len=1 must be >= 2 (tokens per sample: a position and the token it predicts)",
    ),
    (
        "spectrain.fit",
        (*FIT, "trainer.devices=[0,0]"),
        None,
        "trainer.devices=[0,0] must be auto, a count >= 1, -1 (every device) or a list of device ids such as [0,1]",
    ),
    (
        "spectrain.fit",
        (*FIT, "optim.betas=[0.9,1.5]"),
        None,
        "optim.betas=[0.9,1.5] must be two numbers in [0, 1), such as [0.9,0.95]",
    ),
    (
        "spectrain.fit",
        (*FIT, "trainer.max_steps=abc"),
        None,
        "bad override: trainer.max_steps=abc: Value 'abc' of type 'str' could not be converted to Integer",
    ),
    ("spectrain.fit", (*FIT, "kind=specblok"), None, "unknown kind 'specblok'; registered kinds: {KINDS}"),
    (
        "spectrain.fit",
        ("recipe=eagle3_smolm2",),
        None,
        "unknown recipe 'eagle3_smolm2'; available: {RECIPES} (in {RECIPES_DIR}/recipe)",
    ),
    # training: a named resume checkpoint is checked first, before the data it would train on (issue 35)
    (
        "spectrain.fit",
        ("recipe=hrad_smollm2", "target={B}/target", "runs_dir={B}/runs", "resume={B}/nowhere.ckpt"),
        None,
        "resume={B}/nowhere.ckpt: no such checkpoint; use resume=auto or a path to a .ckpt file",
    ),
    (
        "spectrain.fit",
        (*FIT, "resume={B}/notckpt.ckpt"),
        None,
        "resume={B}/notckpt.ckpt is not a checkpoint of python -m spectrain.fit (truncated, or another file or "
        "directory); give runs/<run>/checkpoints/last.ckpt (or stepN.ckpt), or resume=auto",
    ),
    # training: model fields and data that do not fit the recipe write no run directory
    (
        "spectrain.fit",
        (*FIT, "model.ttt_steps=0"),
        None,
        "model.gamma=4 exceeds model.ttt_steps=0: the draft steps simulated must be trained; set model.ttt_steps "
        ">= 4 or a smaller model.gamma",
    ),
    (
        "spectrain.fit",
        (*FIT, "vocab_map={B}/vocab_v1000.st"),
        None,
        "model.vocab_map={B}/vocab_v1000.st maps a 1000-token vocabulary but target '{B}/target' has 49152 tokens "
        "(built for another tokenizer); rebuild it with python -m data_prep.vocab target={B}/target ...",
    ),
    (
        "spectrain.fit",
        (*FIT, "vocab_map={B}/vocab_k100.st"),
        None,
        "model.vocab_map={B}/vocab_k100.st has 100 draft ids but model.draft_vocab_size=64; set "
        "model.draft_vocab_size=100 (or 0: the map's size) or rebuild the map with that size",
    ),
    (
        "spectrain.fit",
        (*FIT, "vocab_map={B}/vocab_trunc.st"),
        None,
        "{B}/vocab_trunc.st is damaged (truncated or not a safetensors file: Error while deserializing header: "
        "invalid header length); rebuild it with python -m data_prep.vocab",
    ),
    (
        "spectrain.fit",
        (*FIT, "dataset_dir={B}/feats_other"),
        None,
        "data.dataset_dir={B}/feats_other was made for target '{B}/other' ({OTHER_ID}), not '{B}/target' "
        "({TARGET_ID}): re-create it with python -m data_prep.extract target={B}/target, or train for the target "
        "it was made for",
    ),
    (
        "spectrain.fit",
        (*FIT, "layers=[1,3,99]"),
        None,
        "layers=[1, 3, 99]: 99 is not a layer id of a 8-layer target (0..7, negative counts from the end)",
    ),
    (
        "spectrain.fit",
        (*FIT, "dataset_dir={B}/feats", "layers=[1,3,5]"),
        None,
        "{B}/feats holds layers [1, 3, 4] ([1, 3, 4]), the recipe wants [1, 3, 5] ([1, 3, 5]): re-extract with "
        "layers=[1, 3, 5]",
    ),
    # a chat template that is not there or not text
    (
        "inference.evaluate",
        (*EVAL, "algorithms=ar", "chat_template={B}/nope.jinja"),
        None,
        "chat_template={B}/nope.jinja: no such file; pass auto|none|PATH (PATH: a Jinja template file)",
    ),
    (
        "data_prep.extract",
        (*EXTRACT, "chat_template={B}/binary.jsonl", "out={B}/x"),
        None,
        "chat_template={B}/binary.jsonl is not UTF-8 text; it must be a Jinja template file",
    ),
    (
        "spectrain.fit",
        (*FIT, "data.chat_template={B}/nope.jinja"),
        None,
        "chat_template={B}/nope.jinja: no such file; pass auto|none|PATH (PATH: a Jinja template file)",
    ),
    # a directory of exports with a damaged one: refused naming the file, not skipped
    (
        "inference.evaluate",
        (*EVAL, "algorithms=eagle3_tree", "drafters={B}/exports_broken"),
        None,
        "{B}/exports_broken/eagle3/config.json is damaged (not JSON: Expecting value, line 3 column 22); re-export "
        "it (python -m spectrain.export) or remove the directory",
    ),
    # options that do nothing in this setting (refused naming the option, why, and the fix)
    (
        "inference.evaluate",
        (*EVAL, "algorithms=ssd", "drafter={B}/other", "ssd.fast=random"),
        None,
        "ssd.fast does nothing with ssd.fallback=jit; set ssd.fallback=fast or auto or drop ssd.fast",
    ),
    (
        "inference.evaluate",
        (*EVAL, "algorithms=ssd", "drafter={B}/other", "ssd.fork_vocab=draft"),
        None,
        "ssd.fork_vocab does nothing with ssd.draft_vocab=0; set ssd.draft_vocab=N (a vocabulary-limited drafter) or "
        "drop ssd.fork_vocab",
    ),
    (
        "inference.generate",
        (*GEN, "algorithm=self_draft", "self_draft.corpus_candidates=2"),
        None,
        "self_draft.corpus_candidates does nothing with self_draft.corpus=None; set self_draft.corpus=FILE (python -m "
        "data_prep.ngram_corpus) or drop self_draft.corpus_candidates",
    ),
    (
        "inference.serve.server",
        (*SERVE, "algorithm=eagle3_tree", "adapt=bandit", "adapt.lora_rank=4"),
        None,
        "adapt.lora_rank does nothing with adapt.arms=head,full; set adapt.arms with lora in it (e.g. "
        "adapt.arms=head,full,lora) or drop adapt.lora_rank",
    ),
    (
        "inference.evaluate",
        (*EVAL, "algorithms=specbranch@hrad=class0@epsilon=0.5"),
        None,
        "algorithm variant 'specbranch@hrad=class0@epsilon=0.5': specbranch.epsilon does nothing with "
        "specbranch.hrad=class0; set specbranch.hrad=none, oracle or an H-RAD export (class0, class2 and oracle_keep "
        "never cut by confidence) or drop specbranch.epsilon",
    ),
    (
        "inference.evaluate",
        (*EVAL, "top_k=5"),
        None,
        "top_k does nothing at temperature=0 (greedy: the argmax, which no top_k or top_p removes, and no random "
        "draw); set temperature > 0 to sample, or drop top_k",
    ),
    (
        "inference.generate",
        (*GEN, "seed=3"),
        None,
        "seed does nothing at temperature=0 (greedy: the argmax, which no top_k or top_p removes, and no random "
        "draw); set temperature > 0 to sample, or drop seed",
    ),
    (
        "data_prep.extract",
        (*EXTRACT, "temperature=0.7", "out={B}/x"),
        None,
        "temperature does nothing with regenerate=false (the source's own answers are extracted, nothing is "
        "generated); set regenerate=true or drop temperature",
    ),
    (
        "data_prep.extract",
        (*EXTRACT, "max_new_tokens=64", "out={B}/x"),
        None,
        "max_new_tokens does nothing with regenerate=false (the source's own answers are extracted, nothing is "
        "generated); set regenerate=true or drop max_new_tokens",
    ),
    # the DFlash layout asked of another kind's drafter
    (
        "spectrain.export",
        ("ckpt={B}/e3", "format=dflash", "out={B}/y"),
        None,
        "format=dflash is a DFlash layout; an EAGLE-3 drafter exports as format=native, sglang or speculators",
    ),
    (
        "spectrain.export",
        ("import={B}/e3", "format=dflash", "out={B}/y"),
        None,
        "format=dflash is a DFlash layout; an EAGLE-3 drafter exports as format=native, sglang or speculators",
    ),
]


@pytest.mark.parametrize(
    "cli, argv, setup, message", CASES, ids=[f"{c[0].rsplit('.', 1)[-1]}-{i}" for i, c in enumerate(CASES)]
)
def test_bad_input_is_one_line_with_exit_code_2_and_leaves_nothing(
    cli, argv, setup, message, B, names, capsys, monkeypatch
):
    if setup is not None:
        setup(monkeypatch, B)
    main = importlib.import_module(cli).main
    before = tree(B)
    capsys.readouterr()
    code = main([arg.format(B=B) for arg in argv])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    kinds = ", ".join(available_kinds())  # now: other tests register kinds of their own
    assert code == 2 and lines == [f"error: {message.format(B=B, KINDS=kinds, **names)}"], lines
    assert captured.out == "", f"a refusal printed to stdout: {captured.out!r}"  # stdout is for results only
    after = tree(B)
    assert after == before, (
        "a partial output was left behind, or a file changed: "
        f"{sorted(k for k in after.keys() | before.keys() if after.get(k) != before.get(k))}"
    )


def test_check_output_accepts_what_can_be_written(tmp_path):
    from core.atomic import check_output

    assert check_output(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"  # created later, not now
    assert not (tmp_path / "new").exists()
    assert check_output(tmp_path) == tmp_path  # an existing directory (resume, or results overwritten)
    (tmp_path / "f.json").write_text(json.dumps({}))
    assert check_output(tmp_path / "f.json", file=True) == tmp_path / "f.json"
