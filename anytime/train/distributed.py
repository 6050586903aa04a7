"""Data-parallel training: the processes `torchrun` (or `anytime train --nproc N`) starts, and what they share.

Every process builds the same model from the same seed and reads the same seeded permutation of each epoch;
each takes its own rows of every global batch, and DistributedDataParallel averages the gradients. Process 0
alone writes the run folder. gloo on CPUs, NCCL on CUDA GPUs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
from torch import Tensor, nn

from anytime.errors import AnytimeError, PeerStopped
from anytime.train.launch import place_from_environment

TIMEOUT = timedelta(minutes=10)  # a collective that waits longer means a peer is gone
_joined = [False]  # set by Distributed.start: this process has been part of a process group


class _SumOverProcesses(torch.autograd.Function):
    """An all-reduce (sum) that autograd differentiates: each process's output is the sum of every process's
    input, so the gradient of an input is the sum of every process's output gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor) -> Tensor:
        import torch.distributed as dist

        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        import torch.distributed as dist

        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad


class SyncedBatchNorm2d(nn.BatchNorm2d):
    """Batch norm whose training statistics are those of the global batch, all processes' rows together, on any
    device (torch's SyncBatchNorm runs on GPUs only). Sums and sums of squares are added up over the processes
    by an all-reduce that autograd differentiates, so the gradient is that of batch norm over the whole batch;
    in evaluation it is plain batch norm. The state dict is batch norm's."""

    def forward(self, x: Tensor) -> Tensor:
        """Normalise by the global batch's statistics in training (updating the running ones), by the running
        statistics in evaluation."""
        if not self.training:
            return super().forward(x)
        channels = x.shape[1]
        values = x if x.dtype in (torch.float32, torch.float64) else x.float()  # bf16/fp16 under autocast
        dims = [0, 2, 3]
        local = torch.cat([values.sum(dims), (values * values).sum(dims),
                           values.new_full((1,), float(x.numel() // channels))])  # fmt: skip
        totals = _SumOverProcesses.apply(local)
        count = totals[-1]
        mean = totals[:channels] / count
        var = (totals[channels : 2 * channels] / count - mean * mean).clamp_min(0.0)
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)  # type: ignore[union-attr,operator]
                factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                unbiased = var * (count / (count - 1).clamp_min(1.0))
                self.running_mean.lerp_(mean.detach(), factor)
                self.running_var.lerp_(unbiased.detach(), factor)
        # y = x * a + b per channel, in one pass over the activations (autograd goes through a and b to the statistics)
        a = torch.rsqrt(var + self.eps)
        if self.affine:
            a = a * self.weight
        b = -mean * a + (self.bias if self.affine else 0.0)
        return torch.addcmul(b[None, :, None, None], values, a[None, :, None, None])


def sync_batch_norms(model: nn.Module) -> int:
    """Turn every plain ``nn.BatchNorm2d`` of ``model`` into a :class:`SyncedBatchNorm2d`, in place (weights and
    statistics kept); returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is nn.BatchNorm2d:
            module.__class__ = SyncedBatchNorm2d
            count += 1
    return count


@dataclass(frozen=True)
class Distributed:
    """This process's place among the data-parallel processes. ``sync_bn``: batch norm over the global batch
    (:class:`SyncedBatchNorm2d`), so that the processes train the model one process would, at the cost of two
    all-reduces per batch-norm layer and step; off (as torch's DDP), each process normalises by its own rows."""

    rank: int
    world_size: int
    local_rank: int
    sync_bn: bool = False

    @property
    def main(self) -> bool:
        """Whether this is process 0, the one that writes the run folder and prints."""
        return self.rank == 0

    @property
    def part(self) -> tuple[int, int]:
        """``(rank, world_size)``, as the batch loader takes it."""
        return self.rank, self.world_size

    def device(self, device: torch.device) -> torch.device:
        """The device of this process: its own GPU (by local rank) on CUDA."""
        return torch.device("cuda", self.local_rank) if device.type == "cuda" else device

    def start(self, device: torch.device) -> str:
        """Join the process group (gloo, or NCCL for CUDA); returns the backend."""
        import torch.distributed as dist

        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            if self.local_rank >= torch.cuda.device_count():
                raise AnytimeError(f"process {self.rank} is local rank {self.local_rank} but this machine has "
                                   f"{torch.cuda.device_count()} GPU(s); start at most one process per GPU")  # fmt: skip
            torch.cuda.set_device(self.local_rank)
        if not dist.is_initialized():
            try:
                dist.init_process_group(backend, rank=self.rank, world_size=self.world_size, timeout=TIMEOUT)
            except (RuntimeError, ValueError) as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise AnytimeError(f"process {self.rank} could not join the others ({first}); check MASTER_ADDR "
                                   "and MASTER_PORT, or start with `anytime train --nproc N`") from None  # fmt: skip
        _joined[0] = True
        return backend

    def stop(self, *, together: bool = True) -> None:
        """Leave the process group; ``together``: first wait for the others (a process that tears its connections
        down while a peer still uses them makes that peer abort)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        if together:
            dist.barrier()
        dist.destroy_process_group()

    def wrap(self, module: nn.Module, device: torch.device, *, find_unused: bool) -> nn.Module:
        """``module`` in DistributedDataParallel (its gradients averaged over the processes in backward)."""
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids, find_unused_parameters=find_unused)

    def sum(self, tensor: Tensor) -> Tensor:
        """``tensor`` summed over the processes (in place, and returned)."""
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def share_buffers(self, *modules: nn.Module | None) -> None:
        """Give every process process 0's buffers (batch-norm statistics drift apart: each saw its own rows)."""
        import torch.distributed as dist

        for module in modules:
            if module is None:
                continue
            for buffer in module.buffers():
                dist.broadcast(buffer, src=0)

    def agree(self, error: str | None) -> None:
        """Process 0 passes its verdict on starting (None, or why not) to the others, which raise it as
        :class:`PeerStopped`; process 0 raises its own error itself."""
        import torch.distributed as dist

        verdict: list[str | None] = [error]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None and not self.main:
            raise PeerStopped(verdict[0])


def joined_a_group() -> bool:
    """Whether this process has joined a process group (:meth:`Distributed.start`), even one it has left."""
    return _joined[0]


def end_process(status: int) -> NoReturn:
    """End a process that has been part of a process group now, with ``status``, skipping the interpreter's
    teardown (as Python's own multiprocessing ends its children).

    gloo's worker threads may still be letting go of the last collectives' tensors when the main thread
    returns; one that needs the interpreter after its teardown has begun aborts the whole process
    ("terminate called without an active exception"), about one exit in ten without a barrier, more rarely
    after one, so a run that succeeded could end killed by a signal. Everything the process writes is written
    and closed by then; only the standard streams are flushed here.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can be said on it
            pass
    os._exit(status)


def from_environment(environ: Mapping[str, str] | None = None, *, sync_bn: bool = False) -> Distributed | None:
    """The process's place from the variables torchrun (or SLURM through torchrun) sets; None when it runs alone."""
    place = place_from_environment(environ)
    if place is None:
        return None
    rank, world, local = place
    return Distributed(rank=rank, world_size=world, local_rank=local, sync_bn=sync_bn)
