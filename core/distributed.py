"""Which process this is, and loss denominators shared by the processes of a data-parallel training run.

DDP averages the processes' gradients. A loss that is a mean over one process's supervised positions then weights
a position by ``1 / (W * count_on_its_process)``, not ``1 / count_in_the_global_batch`` as one process with the
whole batch does, so N processes with batch b would not train like one process with batch N*b whenever the
processes hold different numbers of supervised tokens (ragged masks, valid-prefix slots). ``process_mean``
divides by the count summed over the processes (times W, which DDP's averaging divides out again), which makes the
two equal up to float rounding.

The reduction is a collective: it runs only while training switched it on (``reduce_across_processes``), never in
serving code that happens to share a process group (the multiprocess executor) and calls the same losses.
"""

from __future__ import annotations

import torch

_REDUCE = False


def process_rank() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised process group, ``(0, 1)`` without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def reduce_across_processes(enabled: bool) -> None:
    """Switch the loss-denominator reduction on (data-parallel training with > 1 process) or off."""
    global _REDUCE
    _REDUCE = bool(enabled)


def process_sum(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over the processes (a detached copy) when the reduction is on; else ``tensor`` itself."""
    if not _REDUCE or process_rank()[1] == 1:
        return tensor
    total = tensor.detach().clone()
    torch.distributed.all_reduce(total)
    return total


def process_mean(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``total / count`` with ``count`` the global batch's (see the module docstring); ``count`` 0 divides by 1."""
    world = process_rank()[1] if _REDUCE else 1
    return total * world / process_sum(count).clamp(min=1.0)  # one process: process_sum(count) is count
