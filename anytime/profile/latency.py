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
    functions: Mapping[str, Callable[[Tensor], Any]],
    inputs: Tensor | Sequence[Tensor],
    *,
    warmup: int = 10,
    batch_size: int = 1,
    turn: int = 1,
    clock: Clock = monotonic,
) -> dict[str, np.ndarray]:
    """Seconds each function takes on every batch of ``batch_size`` samples of ``inputs`` (or on every tensor of a
    sequence of batches, e.g. sentences of their own lengths).

    The functions take turns of ``turn`` batches each on the same batches (A then B, then B then A on the next
    turn, so after the first turn each runs ``2 * turn`` batches in a row), so that a machine that slows down or
    speeds up during the measurement affects them alike. With ``turn=1`` most calls find the caches as the other
    function left them, which costs the one with the smaller working set most (an early exit's first stage,
    after a whole backbone: 0.14 ms of 0.65 here); a turn of tens of batches times each as a process serving
    it alone runs it. The first ``warmup`` batches run untimed.
    On CUDA every call is synchronised. Everything runs in inference mode.
    """
    if turn < 1:
        raise ValueError(f"turn is a number of batches >= 1 (got {turn})")
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
        for i, first in enumerate(range(0, len(batches), turn)):
            # The order alternates (A, B, then B, A): whichever runs second on a turn finds the caches in the
            # state the first left, which measurably favours or penalises it on a small machine.
            for name in names if i % 2 == 0 else names[::-1]:
                for x in batches[first : first + turn]:
                    start = clock()
                    functions[name](x)
                    _sync(device)
                    times[name].append(clock() - start)
    return {name: np.asarray(values) for name, values in times.items()}
