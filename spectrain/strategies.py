"""The Lightning strategy a recipe's ``trainer.strategy`` names, and how a drafter is sharded under FSDP.

``fsdp`` is torch's FSDP2 (``fully_shard``) through Lightning's ``ModelParallelStrategy`` with a data-parallel mesh
over every process: it runs on CUDA (NCCL) and on CPU (gloo), whereas Lightning's ``FSDPStrategy`` (FSDP1) refuses
a CPU accelerator. The drafter is one FSDP unit (a drafter is small next to its target; sharding it whole keeps
every method that reads a weight directly working); a method other than ``forward`` that training calls (SpecBlock's
``forward_block``) is registered as a forward method, and validation runs on gathered weights. Frozen parameters
(the target's embeddings a drafter is tied to) stay replicated: they get no gradient to reduce. Checkpoints are
sharded (torch.distributed.checkpoint, one directory per checkpoint), written to a temporary directory and renamed
into place, so a kill mid-write leaves the previous checkpoint intact.

``deepspeed_stage_2|3`` without CUDA runs on DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``), whose
communication backend is gloo when oneCCL is not installed; Lightning's DeepSpeedStrategy only needs its CUDA checks
lifted for that (``cpu_deepspeed_class``). Its CPU backend would JIT-compile a shared-memory all-reduce op on every
machine that lacks it (ninja and g++, 1-4 minutes of both cores of a 2-core host, seen here); that op serves only
DeepSpeed-Inference's tensor-parallel ``inference_all_reduce``, which falls back to torch.distributed without it,
and ZeRO training never calls it, so training marks it unavailable (``skip_shm_comm_build``).
"""

from __future__ import annotations

import functools
import importlib.util
import shutil
from pathlib import Path
from typing import Any

import torch

from core.atomic import replace_directory
from core.overrides import RecipeError


def build_strategy(name: str, cuda: bool) -> Any:
    """The Lightning strategy (object or registry name) for ``trainer.strategy=name``."""
    if name == "fsdp":
        return sharded_strategy_class()()
    if name.startswith("deepspeed"):
        if importlib.util.find_spec("deepspeed") is None:
            raise RecipeError(f"trainer.strategy={name} needs DeepSpeed: pip install -e '.[deepspeed]'")
        from lightning.pytorch.strategies import StrategyRegistry  # Lightning: a heavy import, deferred

        registered = StrategyRegistry.get(name)
        if cuda:
            return registered
        return cpu_deepspeed_class()(stage=registered.config["zero_optimization"]["stage"])
    return name


def shard_drafter(drafter: torch.nn.Module, mesh: Any, forward_methods: tuple[str, ...] = ()) -> None:
    """``fully_shard`` the drafter as one FSDP unit over ``mesh``, its frozen parameters left out (see the module
    docstring); ``forward_methods``: the drafter's methods other than ``forward`` that training calls directly
    (each gathers the parameters and reduces their gradients as ``forward`` does)."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method  # FSDP2: fsdp strategy only

    frozen = {p for p in drafter.parameters() if not p.requires_grad}
    fully_shard(drafter, mesh=mesh, ignored_params=frozen or None)
    for name in forward_methods:
        register_fsdp_forward_method(drafter, name)


@functools.cache
def sharded_strategy_class() -> type:
    """``ModelParallelStrategy`` as pure data-parallel FSDP2 with atomic sharded checkpoints (defined on first use:
    it subclasses a Lightning class)."""
    from lightning.pytorch.strategies import ModelParallelStrategy  # Lightning: a heavy import, deferred

    class ShardedDataParallel(ModelParallelStrategy):
        strategy_name = "fsdp"

        def setup_environment(self) -> None:
            # Every process is one data-parallel shard; no tensor parallelism.
            self._data_parallel_size = self.num_nodes * self.num_processes
            self._tensor_parallel_size = 1
            super().setup_environment()

        def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
            final = Path(self.broadcast(str(filepath)))
            # The same temporary name on every process (each writes its shard into it).
            tmp = final.with_name(f".{final.name}.tmp-{checkpoint.get('global_step', 0)}")
            if self.global_rank == 0 and tmp.exists():
                shutil.rmtree(tmp)
            self.barrier()
            super().save_checkpoint(checkpoint, tmp, storage_options)
            self.barrier()
            if self.global_rank == 0:  # a kill mid-swap leaves no last.ckpt; resume=auto then takes the step file
                replace_directory(tmp, final)
            self.barrier()

    return ShardedDataParallel


@functools.cache
def cpu_deepspeed_class() -> type:
    """Lightning's DeepSpeedStrategy without its CUDA-only check: DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``)
    communicates over gloo when oneCCL is not installed."""
    from lightning.fabric.utilities.seed import reset_seed  # Lightning: heavy, deferred
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    class CPUDeepSpeed(DeepSpeedStrategy):
        @property
        def root_device(self) -> torch.device:
            # DeepSpeed takes the device index as the process's device rank; a CPU device has no index otherwise.
            return torch.device("cpu", self.local_rank)

        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)  # DeepSpeedStrategy's own only refuses a non-CUDA accelerator

        def setup_distributed(self) -> None:
            # As DeepSpeedStrategy's, without its check that CUDA device indices match the local ranks.
            reset_seed()
            self.set_world_ranks()
            skip_shm_comm_build()
            self._init_deepspeed_distributed()

    return CPUDeepSpeed


SHM_COMM_OP = "deepspeed_shm_comm"  # ShareMemCommBuilder.NAME in DeepSpeed's CPU op builders


def skip_shm_comm_build() -> None:
    """Mark DeepSpeed's shared-memory all-reduce op unavailable, so that its torch backend does not JIT-compile it
    when the process group starts (the module docstring says why training never needs it)."""
    import deepspeed.ops  # DeepSpeed: deepspeed strategies only

    compatible = deepspeed.ops.__compatible_ops__  # probed once per process; the dict DeepSpeed itself reads
    if SHM_COMM_OP not in compatible:
        raise RuntimeError(
            f"DeepSpeed {deepspeed.__version__} has no op named {SHM_COMM_OP}: update skip_shm_comm_build"
        )
    compatible[SHM_COMM_OP] = False
