"""Each error handler catches only what it must: a user error is one line, a bug inside shows its traceback."""

from __future__ import annotations

import asyncio
import errno
import gc
import json
import sys

import pytest
import safetensors
import torch
from safetensors.torch import save_file

from core.assets import AssetError, load_safetensors
from core.errors import UserError
from core.overrides import OverrideError, run_cli
from data_prep.manifest import new_header
from data_prep.shards import ShardWriter, column
from inference.algorithms.pearl import Pearl
from inference.drafter_index import export_kind, find_exports
from inference.serve.app import event_sender


def cli(action) -> int:
    return run_cli([], lambda argv: action(), doc=None)


@pytest.mark.parametrize(
    "exc",
    [
        UserError("bad n_samples; use n_samples=4"),
        OverrideError("unknown key 'x'"),
        AssetError("w.safetensors is damaged; re-export it"),
        FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/x.jsonl"),
        OSError(errno.ENOSPC, "No space left on device", "/out/shard"),
    ],
)
def test_a_user_error_is_one_line_and_exit_code_2(exc, capsys):
    def fail():
        raise exc

    assert cli(fail) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    if isinstance(exc, OSError):
        assert exc.filename in lines[0]  # the path is named


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("invalid literal for int() with base 10: 'x'"),
        RuntimeError("shape mismatch"),
        KeyError("layers"),
        OSError(errno.EIO, "Input/output error"),
    ],
)
def test_a_bug_propagates_with_its_traceback(exc):
    def fail():
        raise exc

    with pytest.raises(type(exc)):
        cli(fail)


def test_safetensors_read_failures_are_told_apart(tmp_path, monkeypatch):
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.ones(2)}, path)
    path.write_bytes(path.read_bytes()[:-4])  # torn: damaged
    with pytest.raises(AssetError, match=r"w.safetensors is damaged \(truncated or not a safetensors file: "):
        load_safetensors(path, fix="re-export it")
    save_file({"w": torch.ones(2)}, path)

    def denied(name, framework):
        raise PermissionError(errno.EACCES, "Permission denied", name)

    monkeypatch.setattr(safetensors, "safe_open", denied)
    with pytest.raises(AssetError) as exc:
        load_safetensors(path, fix="re-export it")
    assert str(exc.value) == f"{path} cannot be read (Permission denied): check that it is a file you may read"

    def bug(name, framework):
        raise TypeError("safe_open() got an unexpected keyword argument")

    monkeypatch.setattr(safetensors, "safe_open", bug)
    with pytest.raises(TypeError):  # not called damage
        load_safetensors(path, fix="re-export it")


def test_a_damaged_export_config_is_refused_not_skipped(tmp_path):
    export = tmp_path / "exports" / "eagle3"
    export.mkdir(parents=True)
    config = export / "config.json"
    config.write_text('{"spectrain": {"kind": "eag')
    with pytest.raises(UserError) as exc:
        find_exports(tmp_path / "exports")
    assert str(exc.value) == (
        f"{config} is damaged (not JSON: Unterminated string starting at, line 1 column 24);"
        " re-export it (python -m spectrain.export) or remove the directory"
    )
    for text, why in (
        ("[1, 2]", "a JSON list, not an object"),
        ('{"spectrain": "eagle3"}', "its spectrain block names no drafter kind"),
    ):
        config.write_text(text)
        with pytest.raises(UserError, match=f"^{config} is damaged \\({why}\\)"):
            export_kind(export)
    config.write_bytes(b"\xff\xfe{}")
    with pytest.raises(UserError, match=r"is damaged \(not UTF-8 text"):
        export_kind(export)
    config.write_text(json.dumps({"model_type": "llama"}))  # a plain model directory: not an export
    assert export_kind(export) is None and find_exports(tmp_path / "exports") == {}
    config.write_text(json.dumps({"spectrain": {"kind": "eagle3"}}))
    assert find_exports(tmp_path / "exports") == {"eagle3": export}


def test_an_aborted_shard_is_deleted_and_a_failure_inside_propagates(tmp_path):
    columns = {"x": column("int32", ["T"], "ids")}
    writer = ShardWriter(tmp_path / "ds", new_header("test", {}, {}, {}, columns), shard_size=4)
    writer.add([{"x": [1, 2]}], source_end=1)
    assert any((tmp_path / "ds").rglob(".*tmp-*"))  # the shard being written
    writer.close()
    assert not any((tmp_path / "ds").rglob(".*tmp-*"))  # deleted, nothing renamed into place
    writer = ShardWriter(tmp_path / "ds2", new_header("test", {}, {}, {}, columns), shard_size=4)
    writer.add([{"x": [1, 2]}], source_end=1)

    def bug(*exc):
        raise KeyError("a bug while aborting")

    writer._stack.push(bug)
    with pytest.raises(KeyError):
        writer.close()


def test_serves_event_sender_ignores_only_a_closed_loop():
    loop = asyncio.new_event_loop()
    events: asyncio.Queue = asyncio.Queue()
    send = event_sender(loop, events)
    send("chunk")
    loop.run_until_complete(asyncio.sleep(0))
    assert events.get_nowait() == "chunk"
    loop.close()
    send("late")  # the server shut down: nobody is left to tell

    class Broken(asyncio.SelectorEventLoop):
        def call_soon_threadsafe(self, *args):
            raise RuntimeError("a bug")

    broken = Broken()
    with pytest.raises(RuntimeError, match="a bug"):
        event_sender(broken, events)("chunk")
    broken.close()


def test_a_failure_to_release_the_draft_side_is_reported(monkeypatch):
    """An overlapped algorithm's __del__ releases its executor; a failure there is reported with its traceback
    (Python's unraisable hook), not swallowed."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)

    class Executor:
        broken = False

        def close(self):
            raise RuntimeError("draft process would not stop")

    algorithm = Pearl.__new__(Pearl)  # only its executor matters here
    algorithm._executor = Executor()
    del algorithm
    gc.collect()
    assert [type(u.exc_value) for u in seen] == [RuntimeError]
