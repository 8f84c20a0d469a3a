"""Exact resume of a training run: what a checkpoint must hold beyond Lightning's own state (the RNG states), how
it is written (atomically), which one ``resume=auto`` picks, and the final-step checkpoint.

The data position is Lightning's business once the loaders are stateful (``data_prep.datamodules.resumable_loader``).
"""

from __future__ import annotations

import functools
import os
import random
import tempfile
import zipfile
from pathlib import Path
from typing import Any


def is_sharded_checkpoint(path: str | Path) -> bool:
    """A checkpoint directory that ``trainer.strategy=fsdp`` wrote (torch.distributed.checkpoint + meta.pt)."""
    return Path(path).is_dir() and (Path(path) / ".metadata").is_file() and (Path(path) / "meta.pt").is_file()


def checkpoint_layout(path: Path) -> str | None:
    """How the checkpoint at ``path`` was written: ``file`` (one torch.save archive: every strategy but fsdp and
    DeepSpeed), ``sharded`` (fsdp), ``deepspeed`` (its partitioned directory), or None when it is none of these.
    Reads a few bytes, not the checkpoint."""
    if path.is_file():
        return "file" if zipfile.is_zipfile(path) else None
    if is_sharded_checkpoint(path):
        return "sharded"
    if path.is_dir() and (path / "latest").is_file() and (path / "checkpoint").is_dir():
        return "deepspeed"
    return None


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest of ``last.ckpt`` and the ``step<N>.ckpt`` files. A kill between writing ``step<N>.ckpt`` and
    ``last.ckpt`` leaves the step file newer. ``best.ckpt`` is never picked: it is written after validation, so it
    is not where the next training step starts."""
    ckpt_dir = directory / "checkpoints"
    candidates = [
        p
        for p in ckpt_dir.glob("*.ckpt")
        if p.name == "last.ckpt" or (p.stem.startswith("step") and p.stem[len("step") :].isdigit())
    ]
    # On equal times last.ckpt wins; it holds the same state as the step file written just before it.
    return max(candidates, key=lambda p: (p.stat().st_mtime_ns, p.name == "last.ckpt"), default=None)


def collect_rng_states() -> dict[str, Any]:
    """The torch, CUDA, numpy and python RNG states as tensors and plain Python values, which a
    ``torch.load(weights_only=True)`` accepts (Lightning's own helper keeps numpy's array and is refused)."""

    import numpy as np  # numpy, torch: a heavy import, deferred to first use
    import torch

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what :func:`collect_rng_states` returned."""

    import numpy as np  # numpy, torch: a heavy import, deferred to first use
    import torch

    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


@functools.cache
def resume_classes() -> tuple[type, type, type]:
    """``(RngStateCallback, FinalStepCheckpoint, AtomicCheckpointIO)``, defined on first use: they subclass
    Lightning classes, and importing Lightning costs seconds that ``--help`` and recipe errors should not pay."""
    from lightning.pytorch.callbacks import Callback  # Lightning: a heavy import, deferred to first use
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    class RngStateCallback(Callback):
        """Saves the torch, numpy, python (and CUDA) RNG states in every checkpoint; on resume restores them right
        before the first training batch, i.e. after the sanity check and data-loader setup that a fresh process
        runs but the uninterrupted run did not. Exact as long as nothing draws from the global RNG between a
        checkpoint and the next training step: ``resumable_loader`` loaders use their own generators and
        validation in eval mode draws nothing.

        Only rank 0's states are saved and every rank gets them back: ranks are seeded alike
        (``seed_everything``), so their streams are identical unless a kind makes them draw differently."""

        def __init__(self) -> None:
            self._pending: dict[str, Any] | None = None

        @property
        def state_key(self) -> str:  # stable, so checkpoints keep restoring if this class moves
            return "spectrain.rng_states"

        def state_dict(self) -> dict[str, Any]:
            return {"rng": collect_rng_states()}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self._pending = state_dict.get("rng")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if self._pending is not None:
                set_rng_states(self._pending)
                self._pending = None

    class FinalStepCheckpoint(Callback):
        """Writes ``last.ckpt`` after the final step when ``max_steps`` is not a multiple of the checkpoint
        interval, at the point periodic checkpoints are written: a checkpoint taken after ``fit`` returns marks
        the epoch as finished, so a run extended from it would not continue the way an uninterrupted one does."""

        def __init__(self, path: Path, every_n_steps: int) -> None:
            self.path, self.every_n_steps = path, every_n_steps

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            step = trainer.global_step
            # Once global_step reaches max_steps the loop stops: this is the batch that made the final step.
            if step == trainer.max_steps and step % self.every_n_steps:
                trainer.save_checkpoint(str(self.path))

    class AtomicCheckpointIO(TorchCheckpointIO):
        """Writes a checkpoint to a temporary file in its own directory, fsyncs it and renames it over the final
        name, so a process killed mid-write leaves the previous ``last.ckpt`` intact. (Lightning's own writer goes
        through a temporary file in /tmp and ``shutil.move``, a copy when /tmp is another filesystem.)"""

        def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
            import torch  # torch: a heavy import, deferred to first use

            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            # The temporary name does not end in .ckpt, so resume=auto never picks a half-written file.
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as handle:
                    torch.save(checkpoint, handle)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.chmod(tmp, 0o644)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)

    return RngStateCallback, FinalStepCheckpoint, AtomicCheckpointIO
