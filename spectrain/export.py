"""``python -m spectrain.export ckpt=PATH format=native|sglang|speculators|dflash out=DIR`` — export a trained drafter.

``python -m spectrain.export import=PATH [target=NAME_OR_DIR] [format=native] out=DIR`` reads a checkpoint of
another tool back into our module and writes it out: an EAGLE-3 one in the SGLang or speculators/vLLM layout, a
DFlash one in the speculators or z-lab/SGLang layout, a P-EAGLE one in the speculators layout, or one of the
SpecBlock reference release (auto-detected: the kind whose layouts recognise the directory,
``core.drafters.kinds``).

``ckpt=`` is a Lightning checkpoint of ``python -m spectrain.fit`` (the training contract:
:mod:`spectrain.checkpoint_reading`), whose metadata names its kind, or an export directory in any layout
(re-export to another layout). Each kind's exporter (``spectrain/kinds/<kind>/export.py``, registered with its
training half) writes the output directory, atomically (it must not exist yet): ``config.json`` (with the
``spectrain`` block: kind, target identity, architecture, layer ids + convention, vocab map sizes),
``model.safetensors``, ``recipe.yaml`` when the checkpoint has a recipe, and ``metrics.json`` (training metrics and
provenance). Layouts and their engine conventions: :mod:`core.drafters.eagle3.layouts` (EAGLE-3: native, sglang,
speculators), :mod:`core.drafters.dflash.layouts` (DFlash: native, speculators, dflash) and
:mod:`core.drafters.peagle.layouts` (P-EAGLE: native, speculators). ``verifier=PATH_OR_ID`` (speculators layout
only) names the target as vLLM/speculators should load it; by default the target's local directory.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.assets import check_model_reference
from core.atomic import check_output
from core.drafters.checkpoint_files import CheckpointError
from core.drafters.kinds import engine_kinds, kind_of_directory
from core.overrides import OverrideError, parse_cli, run_cli
from spectrain.checkpoint_contract import DTYPES
from spectrain.checkpoint_reading import checkpoint_kind, reading_once
from spectrain.registry import get_kind
from spectrain.resume import is_sharded_checkpoint

# what a directory that no kind recognises goes to: its reader explains what such a directory lacks
UNRECOGNISED_SOURCE_KIND = "eagle3"
USAGE = (
    "python -m spectrain.export ckpt=PATH format=native|sglang|speculators|dflash [verifier=PATH_OR_ID] "
    "out=DIR  |  "
    "python -m spectrain.export import=PATH [target=NAME_OR_DIR] [format=native] out=DIR"
)


@dataclass
class ExportConfig:
    ckpt: str | None = None  # a Lightning .ckpt (drafter.* state dict + "spectrain" metadata) or an export dir
    import_path: str | None = None  # given on the command line as import=PATH
    format: str = "native"  # EAGLE-3: native | sglang | speculators; DFlash: native | speculators | dflash;
    #                         P-EAGLE: native | speculators
    out: str | None = None
    target: str | None = None  # target name or HF dir: identity for foreign checkpoints, checked otherwise
    dtype: str = "auto"  # auto (as stored) | float32 | bfloat16 | float16
    speculative_tokens: int = 3  # EAGLE-3 speculators layout: vLLM's default num_speculative_tokens (DFlash's is
    #                              always block_size - 1, P-EAGLE's num_depths: one forward drafts them)
    verifier: str | None = None  # speculators layout: the target as vLLM/speculators load it (local dir or hub
    #                              id); default: the target's local directory, never our alias (smollm2)


def formats() -> tuple[str, ...]:
    """Every layout some kind exports (each kind's exporter refuses the others)."""
    return tuple(dict.fromkeys(layout for kind in engine_kinds().values() for layout in kind.layouts))


def source_kind(source: str) -> str:
    """The drafter kind of an export source: a Lightning checkpoint's recorded kind, or the kind whose layouts
    recognise the directory."""
    path = Path(source)
    if path.is_dir() and not is_sharded_checkpoint(path):
        found = kind_of_directory(path)
        return found[0] if found else UNRECOGNISED_SOURCE_KIND
    return checkpoint_kind(source) or UNRECOGNISED_SOURCE_KIND


def export(cfg: Any) -> Path:
    """Run the export a config describes; returns the output directory."""
    if bool(cfg.ckpt) == bool(cfg.import_path):
        raise OverrideError(f"give exactly one of ckpt=PATH or import=PATH; usage: {USAGE}")
    if cfg.format not in formats():
        raise OverrideError(f"format must be one of {', '.join(formats())}, got '{cfg.format}'")
    if cfg.dtype not in DTYPES:
        raise OverrideError(f"dtype must be one of {', '.join(DTYPES)}, got '{cfg.dtype}'")
    if not cfg.out:
        raise OverrideError(f"out=DIR is required; usage: {USAGE}")
    if cfg.verifier and cfg.format != "speculators":
        raise OverrideError(
            f"verifier= names the target in the speculators layout only; drop it or add "
            f"format=speculators (got format={cfg.format})"
        )
    if cfg.verifier:
        check_model_reference(cfg.verifier)
    out = check_output(cfg.out)  # before reading anything
    if out.is_dir() and any(out.iterdir()):
        raise CheckpointError(f"out={out} already exists; choose a new directory (exports are never overwritten)")
    source = cfg.ckpt or cfg.import_path
    with reading_once():  # the kind is read from the checkpoint the exporter reads again
        kind = get_kind(source_kind(source))
        if kind.export_checkpoint is None:
            raise CheckpointError(f"{source} holds a '{kind.name}' drafter, and that kind registers no exporter")
        return kind.export_checkpoint(Path(source), cfg)


def parse_args(argv: Sequence[str]) -> Any:
    # "import" is a Python keyword, so the schema field is import_path; accept the documented spelling.
    argv = [("import_path=" + a.split("=", 1)[1]) if a.startswith("import=") else a for a in argv]
    return parse_cli(argv, ExportConfig, USAGE)


def main(argv: Sequence[str] | None = None) -> int:
    def run(args: list[str]) -> tuple[Any, Path]:
        cfg = parse_args(args)
        return cfg, export(cfg)

    def report(result: tuple[Any, Path]) -> None:
        print(f"[export] wrote {result[0].format} drafter to {result[1]}", file=sys.stderr)

    return run_cli(argv, run, doc=__doc__, schema=ExportConfig, report=report)


if __name__ == "__main__":
    sys.exit(main())
