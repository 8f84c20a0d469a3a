"""Bad inputs a new user gives the CLIs: each ends in ONE line on stderr (``error: ...``, exit code 2) that names
the problem and the fix, before any work where it can be found early (issue 24, item 5).

Every case calls the CLI's ``main(argv)`` in-process against tiny random targets and exports built once per
module; ``{B}`` in an argument is the fixtures' directory.
"""

from __future__ import annotations

import errno
import importlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_targets import save_tiny_target, write_jsonl

REPO = Path(__file__).resolve().parents[1]


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
    drafter = Eagle3Drafter(Eagle3Config.for_target(AutoConfig.from_pretrained(target), draft_vocab_size=64,
                                                    aux_layer_ids=[1, 3, 4]))
    vocab = drafter.config.vocab_size
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:64] = True
    drafter.set_vocab_map(torch.zeros(64, dtype=torch.long), t2d)
    state = {f"drafter.{k}": v for k, v in drafter.state_dict().items()}
    torch.save({"state_dict": state, "global_step": 1,
                "spectrain": checkpoint_metadata(drafter, target_record(str(target)))}, root / "e3.ckpt")
    assert export.main([f"ckpt={root / 'e3.ckpt'}", f"out={root / 'e3'}"]) == 0
    weights = (root / "e3" / "model.safetensors").read_bytes()
    for name, data in (("e3trunc", weights[: len(weights) // 2]), ("e3rand", np.random.default_rng(0).bytes(len(weights)))):
        shutil.copytree(root / "e3", root / name)
        (root / name / "model.safetensors").write_bytes(data)
    shutil.copytree(root / "e3", root / "e3nan")
    tensors = load_file(root / "e3" / "model.safetensors")
    tensors["fc.weight"] = tensors["fc.weight"].clone()
    tensors["fc.weight"][0, 0] = float("nan")
    save_file(tensors, root / "e3nan" / "model.safetensors")
    shutil.copytree(root / "e3", root / "e3noconf")  # an interrupted copy: weights without config.json
    (root / "e3noconf" / "config.json").unlink()

    # a draft LM (a plain HF directory) with torn weights
    shutil.copytree(other, root / "lm_trunc")
    lm_weights = (other / "model.safetensors").read_bytes()
    (root / "lm_trunc" / "model.safetensors").write_bytes(lm_weights[: len(lm_weights) // 2])

    # vocabulary maps: of another target's vocabulary size, of another draft size, damaged
    save_vocab_map(root / "vocab_v1000.st", *build_vocab_map(np.arange(1000), 64), {})
    save_vocab_map(root / "vocab_k100.st", *build_vocab_map(np.arange(vocab), 100), {})
    (root / "vocab_trunc.st").write_bytes((root / "vocab_k100.st").read_bytes()[:100])

    # a feature dataset of the OTHER target
    assert extract.main([f"target={other}", f"source=jsonl:{root / 'chats.jsonl'}", "n_samples=4", "max_len=32",
                         "dtype=fp32", f"out={root / 'feats_other'}"]) == 0
    return root


def disk_full(monkeypatch, B: Path) -> None:
    """Every safetensors write hits a full disk."""
    import safetensors.torch

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)


def nothing_left(B: Path, name: str) -> None:
    assert not (B / name).exists() and not list(B.glob(f".{name}.tmp-*")), "a partial output was left behind"


EVAL = ("target={B}/target", "n_prompts=1", "max_new_tokens=2", "bench=jsonl:{B}/chats.jsonl", "warmup=false",
        "out={B}/eval")
GEN = ("target={B}/target", "prompt=hi", "max_new_tokens=2")
EXTRACT = ("target={B}/target", "source=jsonl:{B}/chats.jsonl", "n_samples=2", "max_len=32")
TRACES = ("target={B}/target", "drafter={B}/other", "source=jsonl:{B}/chats.jsonl", "n_samples=1", "max_new_tokens=4")
FIT = ("recipe=eagle3_smollm2", "target={B}/target", "max_len=32", "batch_size=2", "max_steps=1", "runs_dir={B}/runs",
       "draft_vocab_size=64", "layers=[1,3,4]", "dtype=fp32", "source=jsonl:{B}/chats.jsonl", "n_samples=4",
       "n_val_samples=2")

# (CLI module, argv, setup before the call, fragment of the one line, check after the call)
CASES = [
    # damaged or unusable exports, wherever a drafter is loaded
    ("inference.evaluate", (*EVAL, "algorithms=eagle3_tree", "feature_drafter={B}/e3trunc"), None,
     "e3trunc/model.safetensors is damaged (truncated or not a safetensors file", None),
    ("inference.evaluate", (*EVAL, "algorithms=eagle3_tree", "feature_drafter={B}/e3rand"), None,
     "e3rand/model.safetensors is damaged", None),
    ("inference.evaluate", (*EVAL, "algorithms=eagle3_tree", "feature_drafter={B}/e3nan"), None,
     "holds NaN/inf values (tensor 'fc.weight')", None),
    ("inference.evaluate", (*EVAL, "algorithms=eagle3_tree", "feature_drafter={B}/e3noconf"), None,
     "has model.safetensors but no config.json: an interrupted or incomplete copy of an export; re-export", None),
    ("inference.evaluate", (*EVAL, "algorithms=eagle3_tree", "feature_drafter={B}/nowhere"), None,
     "drafter '{B}/nowhere' does not exist", None),
    ("inference.evaluate", (*EVAL, "algorithms=sps", "drafter={B}/lm_trunc"), None,
     "the weights of '{B}/lm_trunc' are damaged", None),
    ("inference.generate", (*GEN, "algorithm=eagle3_tree", "drafter={B}/e3trunc"), None,
     "e3trunc/model.safetensors is damaged", None),
    ("spectrain.export", ("import={B}/e3trunc", "out={B}/re_trunc"), None, "e3trunc/model.safetensors is damaged",
     lambda B: nothing_left(B, "re_trunc")),
    ("spectrain.export", ("import={B}/e3nan", "out={B}/re_nan"), None, "holds NaN/inf values", None),
    # outputs that cannot be written fail before any model loads
    ("inference.evaluate", (*EVAL[:-1], "out={B}/afile"), None, "out={B}/afile is an existing file, not a directory",
     None),
    ("inference.evaluate", (*EVAL[:-1], "out={B}/afile/sub"), None,
     "out={B}/afile/sub cannot be created: {B}/afile is a file, not a directory", None),
    ("data_prep.extract", (*EXTRACT, "out={B}/afile"), None, "is an existing file, not a directory", None),
    ("data_prep.extract", (*EXTRACT, "out={B}/afile/sub"), None, "{B}/afile is a file, not a directory", None),
    ("data_prep.traces", (*TRACES, "out={B}/afile/sub"), None, "{B}/afile is a file, not a directory", None),
    ("data_prep.vocab", ("dataset={B}/feats_other", "draft_vocab_size=8", "out={B}/e3"), None,
     "out={B}/e3 is a directory; give a file path", None),
    ("data_prep.vocab", ("dataset={B}/feats_other", "draft_vocab_size=8", "out={B}/afile/map.st"), None,
     "{B}/afile is a file, not a directory", None),
    ("data_prep.ngram_corpus", ("target={B}/target", "source=jsonl:{B}/chats.jsonl", "out={B}/afile/c.json"), None,
     "{B}/afile is a file, not a directory", None),
    ("data_prep.regenerate", ("target={B}/target", "source=jsonl:{B}/chats.jsonl", "out={B}/afile/r.jsonl"), None,
     "{B}/afile is a file where a directory is needed; choose another path", None),
    ("spectrain.export", ("ckpt={B}/e3.ckpt", "out={B}/afile"), None, "is an existing file, not a directory", None),
    ("spectrain.export", ("ckpt={B}/e3.ckpt", "out={B}/afile/sub"), None, "{B}/afile is a file, not a directory",
     None),
    ("inference.demo", ("out={B}/afile",), None, "out={B}/afile is an existing file", None),
    # a full disk: one line, and no half-written export under the final name
    ("spectrain.export", ("ckpt={B}/e3.ckpt", "out={B}/full"), disk_full, "no space left on the device",
     lambda B: nothing_left(B, "full")),
    # prompt sources
    ("inference.evaluate", (*EVAL, "bench=jsonl:{B}/empty.jsonl"), None, "empty.jsonl holds no conversations", None),
    ("inference.evaluate", (*EVAL, "bench=jsonl:{B}/binary.jsonl"), None, "binary.jsonl:1: not UTF-8 text", None),
    ("data_prep.extract", (*EXTRACT, "source=jsonl:{B}/binary.jsonl", "out={B}/x"), None, "not UTF-8 text", None),
    ("data_prep.extract", (*EXTRACT, "source=jsonl:{B}/empty.jsonl", "out={B}/x"), None, "no conversations", None),
    ("inference.evaluate", (*EVAL, "bench=unknown"), None, "unknown prompt source 'unknown'; known:", None),
    # values
    ("inference.evaluate", (*EVAL, "n_prompts=0"), None, "n_prompts and batch_size must be >= 1", None),
    ("inference.evaluate", (*EVAL, "temperature=-1"), None, "temperature must be a finite number >= 0", None),
    ("inference.evaluate", (*EVAL, "algorithms=eagle3_tre"), None, "unknown algorithm 'eagle3_tre'; available:",
     None),
    ("inference.generate", (*GEN, "prompt="), None, "prompt= has no value", None),
    ("inference.generate", (*GEN, "algorithm=sps"), None, "needs a draft LM", None),
    ("data_prep.extract", (*EXTRACT, "dtype=fp8", "out={B}/x"), None, "dtype=fp8 is not a storage dtype", None),
    ("data_prep.extract", (*EXTRACT, "n_samples=abc", "out={B}/x"), None,
     "bad value in n_samples=abc: Value 'abc' of type 'str' could not be converted to Integer", None),
    ("spectrain.export", ("ckpt={B}/e3.ckpt", "format=unknown", "out={B}/y"), None,
     "format must be one of native, sglang, speculators", None),
    ("spectrain.export", ("ckpt={B}/e3.ckpt", "dtype=fp8", "out={B}/y"), None, "dtype must be one of", None),
    ("spectrain.export", ("ckpt={B}/notckpt.ckpt", "out={B}/y"), None, "is not a readable Lightning checkpoint", None),
    # models given in the wrong place
    ("inference.evaluate", (*EVAL, "target={B}/e3"), None, "is a spectrain eagle3 export, not a causal LM", None),
    ("inference.evaluate", (*EVAL, "target={B}/nowhere"), None, "unknown model '{B}/nowhere'", None),
    # training
    ("spectrain.fit", (*FIT, "dataset_dir={B}/feats_other"), None,
     "data.dataset_dir={B}/feats_other was made for target '{B}/other'", None),
    ("spectrain.fit", (*FIT, "trainer.max_steps=abc"), None,
     "bad override: trainer.max_steps=abc: Value 'abc' of type 'str' could not be converted to Integer", None),
    ("spectrain.fit", (*FIT, "vocab_map={B}/vocab_v1000.st"), None, "maps a 1000-token vocabulary", None),
    ("spectrain.fit", (*FIT, "vocab_map={B}/vocab_k100.st"), None, "has 100 draft ids but model.draft_vocab_size=64",
     None),
    ("spectrain.fit", (*FIT, "vocab_map={B}/vocab_trunc.st"), None, "vocab_trunc.st is damaged", None),
    ("spectrain.fit", (*FIT, "source=jsonl:{B}/empty.jsonl"), None, "holds no conversations", None),
    ("spectrain.fit", ("recipe=eagle3_smolm2",), None, "unknown recipe 'eagle3_smolm2'", None),
    # a chat template that is not there or not text
    ("inference.evaluate", (*EVAL, "algorithms=ar", "chat_template={B}/nope.jinja"), None,
     "chat_template={B}/nope.jinja: no such file", None),
    ("data_prep.extract", (*EXTRACT, "chat_template={B}/binary.jsonl", "out={B}/x"), None,
     "is not UTF-8 text; it must be a Jinja template file", None),
    ("spectrain.fit", (*FIT, "data.chat_template={B}/nope.jinja"), None, "nope.jinja: no such file", None),
]


@pytest.mark.parametrize("cli, argv, setup, fragment, after", CASES,
                         ids=[f"{c[0].rsplit('.', 1)[-1]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_one_line_with_exit_code_2(cli, argv, setup, fragment, after, B, capsys, monkeypatch):
    if setup is not None:
        setup(monkeypatch, B)
    main = importlib.import_module(cli).main
    capsys.readouterr()
    code = main([arg.format(B=B) for arg in argv])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert fragment.format(B=B) in lines[0], lines[0]
    if after is not None:
        after(B)


def test_check_output_accepts_what_can_be_written(tmp_path):
    from core.atomic import check_output

    assert check_output(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"  # created later, not now
    assert not (tmp_path / "new").exists()
    assert check_output(tmp_path) == tmp_path  # an existing directory (resume, or results overwritten)
    (tmp_path / "f.json").write_text(json.dumps({}))
    assert check_output(tmp_path / "f.json", file=True) == tmp_path / "f.json"
