"""Find the exported drafters in a directory, by kind, so one evaluate run can use all of them.

``python -m spectrain.export`` writes a ``config.json`` whose ``spectrain`` block names the drafter kind (a row of
``core.drafters.kinds``). ``drafters=DIR`` points at such an export or at a directory of them (one level deep, e.g.
``runs/demo/exports/<kind>``).
"""

from __future__ import annotations

import json
from pathlib import Path

from core.errors import UserError


REEXPORT = "re-export it (python -m spectrain.export) or remove the directory"


def export_kind(path: Path) -> str | None:
    """The drafter kind of an export directory, or None when it is not one (no config.json, or one without a
    ``spectrain`` block: a plain model directory). A config.json that does not read as a JSON object, or whose
    ``spectrain`` block is not one naming a kind, is damaged: refused in one line naming it."""
    config = path / "config.json"
    if not config.is_file():
        return None
    try:
        data = json.loads(config.read_text())
    except UnicodeDecodeError as exc:
        raise UserError(f"{config} is damaged (not UTF-8 text: {exc.reason} at byte {exc.start}); {REEXPORT}") from None
    except json.JSONDecodeError as exc:
        raise UserError(
            f"{config} is damaged (not JSON: {exc.msg}, line {exc.lineno} column {exc.colno}); {REEXPORT}"
        ) from None
    if not isinstance(data, dict):
        raise UserError(f"{config} is damaged (a JSON {type(data).__name__}, not an object); {REEXPORT}")
    if "spectrain" not in data:
        return None
    block = data["spectrain"]
    if not isinstance(block, dict) or not isinstance(block.get("kind"), str):
        raise UserError(f"{config} is damaged (its spectrain block names no drafter kind); {REEXPORT}")
    return block["kind"]


def find_exports(root: str | Path) -> dict[str, Path]:
    """kind -> export directory, for ``root`` itself and its direct subdirectories (a damaged export among them is
    refused, not skipped: the run would silently lack that drafter)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(
            f"drafters={root}: no such directory; give a directory of exports from python -m spectrain.export"
        )
    found: dict[str, list[Path]] = {}
    for path in [root, *sorted(p for p in root.iterdir() if p.is_dir())]:
        kind = export_kind(path)
        if kind:
            found.setdefault(kind, []).append(path)
    for kind, paths in found.items():
        if len(paths) > 1:
            raise UserError(
                f"drafters={root} holds {len(paths)} '{kind}' exports ({', '.join(p.name for p in paths)}); "
                f"keep one there or name the one to use explicitly"
            )
    return {kind: paths[0] for kind, paths in found.items()}
