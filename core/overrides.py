"""``key=value`` command-line overrides checked against a schema, with one-line errors.

Shared by every CLI (fit, evaluate, generate, extract): a key is its full dotted path, or its last part when
that is unambiguous; an unknown key names the closest valid one and lists them all.
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import functools
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from core.errors import UserError


class OverrideError(UserError):
    """A bad command-line override; the message is one line naming the fix."""


class RecipeError(OverrideError):
    """A recipe problem; the message is one line naming the fix."""


def split_key_values(argv: Sequence[str], usage: str) -> list[tuple[str, str]]:
    pairs = []
    for arg in argv:
        if "=" not in arg:
            raise OverrideError(f"argument '{arg}' is not key=value; usage: {usage}")
        key, value = arg.split("=", 1)
        pairs.append((key.lstrip("+"), value))
    return pairs


def leaf_keys(cfg: DictConfig, prefix: str = "", open_dicts: Sequence[str] = ()) -> list[str]:
    """Dotted paths of every leaf; dicts named in ``open_dicts`` are listed by their current keys."""
    keys = []
    for key in cfg.keys():
        path = f"{prefix}{key}"
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and path not in open_dicts:
            keys.extend(leaf_keys(node, f"{path}.", open_dicts))
        elif isinstance(node, DictConfig):
            keys.extend(f"{path}.{k}" for k in node.keys())
        else:
            keys.append(path)
    return keys


def resolve_key(key: str, valid: list[str]) -> str:
    if key in valid:
        return key
    by_leaf = [v for v in valid if v.rsplit(".", 1)[-1] == key]
    if len(by_leaf) == 1:
        return by_leaf[0]
    if len(by_leaf) > 1:
        raise OverrideError(f"key '{key}' is ambiguous: write one of {', '.join(by_leaf)}")
    close = difflib.get_close_matches(key, valid + [v.rsplit(".", 1)[-1] for v in valid], n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise OverrideError(f"unknown key '{key}'{hint}; valid keys: {', '.join(valid)}")


@functools.cache
def schema_config(schema: type) -> DictConfig:
    """``OmegaConf.structured(schema)``, built once per schema (tens of milliseconds each, parsed hundreds of times
    in a process that runs many commands). Shared: read it or merge from it (``OmegaConf.merge`` copies), never
    change it."""
    return OmegaConf.structured(schema)


def parse_cli(argv: Sequence[str], schema: type, usage: str) -> Any:
    """Merge ``key=value`` args into the structured ``schema`` dataclass; returns a typed DictConfig."""
    base = schema_config(schema)
    valid = leaf_keys(base)
    dotlist = [f"{resolve_key(k, valid)}={v}" for k, v in split_key_values(argv, usage)]
    try:
        return OmegaConf.merge(base, OmegaConf.from_dotlist(dotlist))
    except Exception as exc:  # OmegaConf's messages are multi-line; keep the first line
        raise OverrideError(
            bad_value(dotlist, exc, lambda item: OmegaConf.merge(base, OmegaConf.from_dotlist([item])))
        ) from None


def bad_value(items: Sequence[str], exc: BaseException, apply_one: Callable[[str], Any]) -> str:
    """One line naming the ``key=value`` of ``items`` that failed (found by applying each alone) and why."""
    for item in items:
        try:
            apply_one(item)
        except Exception as one:  # noqa: BLE001 - any failure names the culprit
            key, _, value = item.partition("=")
            reason = (str(one).splitlines() or [type(one).__name__])[0]
            if not value:
                return f"{key.lstrip('+')}= has no value ({reason}); write {key.lstrip('+')}=VALUE"
            return f"bad value in {item}: {reason}"
    return f"bad value in {' '.join(items)}: {(str(exc).splitlines() or [type(exc).__name__])[0]}"


def error_line(exc: BaseException) -> str:
    """The one line a CLI prints for ``exc``: its first line, or for a bare OS error what went wrong and the fix."""
    if isinstance(exc, OSError) and exc.errno is not None and exc.filename is not None and exc.strerror:
        name = str(exc.filename)
        if exc.errno == errno.ENOSPC:
            return f"no space left on the device while writing {name}: free disk space (or write elsewhere) and re-run"
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return f"cannot write {name} ({exc.strerror}): choose a location you can write to"
        if exc.errno in (errno.ENOTDIR, errno.EEXIST):
            blocker = next((p for p in (Path(name), *Path(name).parents) if p.exists() and not p.is_dir()), None)
            if blocker is not None:
                needed = "" if str(blocker) == name else f" (to write {name})"
                return f"{blocker} is a file where a directory is needed{needed}; choose another path"
        return f"{exc.strerror}: {name}" + (f" -> {exc.filename2}" if exc.filename2 else "")
    if (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or "No space left on device" in str(exc):
        return "no space left on the device: free disk space (or write elsewhere) and re-run"
    lines = str(exc).splitlines()
    return lines[0] if lines and lines[0] else type(exc).__name__


# OS errors a user causes and fixes (a path that is not there, not theirs, or of the wrong kind; a full or read-only
# disk); any other OSError is a bug
USER_OS_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
USER_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EDQUOT)


def is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` is bad input or a full disk (one line for the user) rather than a bug (a traceback)."""
    if isinstance(exc, (UserError, *USER_OS_ERRORS)):
        return True
    if isinstance(exc, OSError) and exc.errno in USER_ERRNOS:
        return True
    # safetensors' own error type derives from no other: only its full-disk write is the user's to fix
    return type(exc).__name__ == "SafetensorError" and "No space left on device" in str(exc)


def help_keys(schema: type) -> list[str]:
    """A schema's keys as a user writes them: a field set from another spelling (``metadata={"cli": "drafter.KIND"}``,
    filled from ``drafter.<kind>=PATH``) shows that spelling, not its internal name."""
    return [item.metadata.get("cli", item.name) for item in dataclasses.fields(schema)]


def run_cli(
    argv: Sequence[str] | None,
    action: Callable[[list[str]], Any],
    *,
    doc: str | None,
    schema: type | None = None,
    report: Callable[[Any], None] | None = None,
) -> int:
    """The shared ``main`` of every key=value CLI: ``--help``, then ``action(argv)``; a user error
    (:func:`is_user_error`: bad input, a missing file, a refused dataset, a full disk) prints ONE line and exits 2;
    anything else is a bug and propagates with its traceback. ``SPECTRAIN_DEBUG=1`` re-raises user errors too."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(doc or "")
        if schema is not None:
            print("keys:", ", ".join(help_keys(schema)))
        return 0
    try:
        result = action(argv)
    except Exception as exc:
        if not is_user_error(exc) or os.environ.get("SPECTRAIN_DEBUG"):
            raise
        print(f"error: {error_line(exc)}", file=sys.stderr)
        return 2
    if report is not None:
        report(result)
    return 0
