"""Wall-clock latency per sample, measured side by side for several ways of answering."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from anytime.utils.timer import Clock, monotonic


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cyclic garbage collector collected first and paused inside, as ``timeit`` does: a collection
    over a process full of traced graphs takes tens of milliseconds and lands in whichever timing it interrupts."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@torch.inference_mode()
def per_sample_latency(
    functions: Mapping[str, Callable[[Tensor], Any]], inputs: Tensor | Sequence[Tensor], *, warmup: int = 10,
    batch_size: int = 1, clock: Clock = monotonic,
) -> dict[str, np.ndarray]:
    """Seconds each function takes on every batch of ``batch_size`` samples of ``inputs`` (or on every tensor of a
    sequence of batches, e.g. sentences of their own lengths).

    The functions run interleaved on the same batch (A then B, then B then A on the next batch), so
    that a machine that slows down or speeds up during the measurement affects them alike. The first ``warmup`` batches run
    untimed. On CUDA every call is synchronised. Everything runs in inference mode.
    """
    if isinstance(inputs, Tensor):
        batches = [inputs[i : i + batch_size] for i in range(0, inputs.shape[0], batch_size)]
    else:
        batches = list(inputs)
    device = batches[0].device
    for x in batches[:warmup]:
        for fn in functions.values():
            fn(x)
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in functions}
    names = list(functions)
    with paused_gc():
        for i, x in enumerate(batches):
            # The order alternates (A, B, then B, A): whichever runs second on a batch finds the caches in the
            # state the first left, which measurably favours or penalises it on a small machine.
            for name in names if i % 2 == 0 else names[::-1]:
                start = clock()
                functions[name](x)
                _sync(device)
                times[name].append(clock() - start)
    return {name: np.asarray(values) for name, values in times.items()}
