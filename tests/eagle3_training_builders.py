"""The tiny EAGLE-3 recipe set-up a fit test trains on."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from tiny_targets import save_tiny_target, write_jsonl
from transformers import LlamaForCausalLM

REPO = Path(__file__).resolve().parents[1]


def eagle3_fit_setup(
    tmp_path: Path,
    recipe: str = "eagle3_smollm2",
    *,
    chats: int = 120,
    samples: int = 40,
    steps: int = 6,
    every: int = 3,
    warmup: int = 2,
) -> tuple[Path, list[str], Path]:
    """A sharpened tiny target, chats and a copy of the recipes: (recipes dir, ``recipe``'s fit arguments, target),
    a validation and a checkpoint every ``every`` of ``steps`` steps."""
    target = save_tiny_target(tmp_path / "target", layers=4, hidden=32)
    model = LlamaForCausalLM.from_pretrained(target)
    with torch.no_grad():  # a sharper teacher than a random tiny model's near-uniform output
        model.lm_head.weight.mul_(30.0)
    model.save_pretrained(target)
    source = write_jsonl(tmp_path / "chats.jsonl", chats)
    recipes = tmp_path / "recipes"
    shutil.copytree(REPO / "recipes", recipes)
    args = [
        f"recipe={recipe}",
        f"target={target}",
        f"source=jsonl:{source}",
        f"n_samples={samples}",
        "n_val_samples=4",
        "max_len=64",
        "batch_size=4",
        "draft_vocab_size=512",
        "ttt_steps=3",
        "gamma=2",
        f"max_steps={steps}",
        f"val_check_interval={every}",
        f"checkpoint_every_n_steps={every}",
        f"warmup_steps={warmup}",
        "lr=5e-3",
        f"runs_dir={tmp_path / 'runs'}",
        "log_every_n_steps=1",
        "layers=[0,1,2]",
    ]
    return recipes, args, target
