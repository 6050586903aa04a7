"""Time and memory of one training mini-batch, split into forward, backward and optimizer step."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from anytime.errors import AnytimeError
from anytime.train.memory import cuda_peak_bytes, peak_rss_bytes
from anytime.train.timing import Clock

T = TypeVar("T")


@dataclass(frozen=True)
class TrainStepTiming:
    """Seconds of each measured iteration, after warm-up, for one model and batch size."""

    batch_size: int
    device: str
    warmup: int
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    step_s: tuple[float, ...]
    peak_rss_mb: float
    cuda_peak_mb: float | None

    def summary(self) -> dict[str, float]:
        """Median and mean per phase, the median total, and throughput in images per second."""
        out: dict[str, float] = {"batch_size": float(self.batch_size), "repeats": float(len(self.forward_s))}
        total = np.zeros(len(self.forward_s))
        for name in ("forward", "backward", "step"):
            values = np.asarray(getattr(self, f"{name}_s"))
            total += values
            out[f"{name}_p50_s"] = float(np.median(values))
            out[f"{name}_mean_s"] = float(values.mean())
            out[f"{name}_std_s"] = float(values.std())
        out["total_p50_s"] = float(np.median(total))
        out["total_mean_s"] = float(total.mean())
        out["images_per_s"] = self.batch_size / out["total_p50_s"]
        return out


def measure_train_step(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    warmup: int = 2,
    repeats: int = 10,
    lr: float = 0.01,
    momentum: float = 0.9,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
) -> TrainStepTiming:
    """Time SGD training iterations on one fixed batch (data loading excluded; see the trainer for that).

    The model is trained in place on the device of ``images``; on CUDA each phase is synchronised.
    ``loss_fn(outputs, labels)`` is the objective (cross-entropy by default).
    """
    device = images.device
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    clock = Clock(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    forward: list[float] = []
    backward: list[float] = []
    step: list[float] = []
    for i in range(warmup + repeats):
        t0 = clock.now()
        loss = loss_fn(model(images), labels)
        t1 = clock.now()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        t2 = clock.now()
        optimizer.step()
        t3 = clock.now()
        if i >= warmup:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
            step.append(t3 - t2)
    cuda_peak = cuda_peak_bytes(device)
    return TrainStepTiming(
        batch_size=int(images.shape[0]),
        device=str(device),
        warmup=warmup,
        forward_s=tuple(forward),
        backward_s=tuple(backward),
        step_s=tuple(step),
        peak_rss_mb=peak_rss_bytes() / 2**20,
        cuda_peak_mb=None if cuda_peak is None else cuda_peak / 2**20,
    )


def _child(conn: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    try:
        conn.send(("ok", fn(*args, **kwargs)))
    except AnytimeError as exc:
        conn.send(("user", str(exc)))
    except BaseException as exc:  # the parent re-raises it with the child's message
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def run_isolated(fn: Callable[..., T], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` in a fresh spawned process and return its (picklable) result.

    Peak memory (``ru_maxrss``) only ever grows within a process, so each memory measurement gets
    a process of its own. ``fn`` must be importable at module level. An :class:`AnytimeError` in the
    child is raised again as one; a child that dies (e.g. killed for memory) or overruns ``timeout_s``
    raises :class:`RuntimeError` saying so, instead of leaving the caller waiting.
    """
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child, args=(sender, fn, args, kwargs))
    process.start()
    sender.close()
    try:
        wait([receiver, process.sentinel], timeout=timeout_s)
        outcome = receiver.recv() if receiver.poll() else None
    except EOFError:
        outcome = None
    finally:
        process.join(timeout=30 if process.exitcode is None else None)
        if process.is_alive():
            process.kill()
            process.join()
        receiver.close()
    if outcome is None:
        raise RuntimeError(
            f"isolated measurement of {getattr(fn, '__name__', fn)} ended without a result "
            f"(exit code {process.exitcode}; a negative code is the signal that killed it, e.g. -9 when out of memory)"
        )
    status, value = outcome
    if status == "user":
        raise AnytimeError(value)
    if status != "ok":
        raise RuntimeError(f"isolated measurement failed: {value}")
    return value
