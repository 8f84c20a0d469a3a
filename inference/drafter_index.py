"""Find the exported drafters in a directory, by kind, so one evaluate run can use all of them.

``python -m spectrain.export`` writes a ``config.json`` whose ``spectrain`` block names the drafter kind
(draft_lm, eagle3, specblock, dflash, peagle, hrad). ``drafters=DIR`` points at such an export or at a directory of
them (one level deep, e.g. ``runs/demo/exports/{draft_lm,eagle3,...}``).
"""

from __future__ import annotations

import json
from pathlib import Path

from core.errors import UserError


def export_kind(path: Path) -> str | None:
    """The drafter kind of an export directory, or None when it is not one."""
    config = path / "config.json"
    if not config.is_file():
        return None
    try:
        block = json.loads(config.read_text()).get("spectrain")
    except json.JSONDecodeError:
        return None
    return block.get("kind") if isinstance(block, dict) else None


def find_exports(root: str | Path) -> dict[str, Path]:
    """kind -> export directory, for ``root`` itself and its direct subdirectories."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"drafters={root}: no such directory; give a directory of exports from "
                                "python -m spectrain.export")
    found: dict[str, list[Path]] = {}
    for path in [root, *sorted(p for p in root.iterdir() if p.is_dir())]:
        kind = export_kind(path)
        if kind:
            found.setdefault(kind, []).append(path)
    for kind, paths in found.items():
        if len(paths) > 1:
            raise UserError(f"drafters={root} holds {len(paths)} '{kind}' exports ({', '.join(p.name for p in paths)}); "
                             f"keep one there or name the one to use explicitly")
    return {kind: paths[0] for kind, paths in found.items()}
