"""Measuring: timed loops run with Python's garbage collector paused, as timeit does."""

from __future__ import annotations

import gc

import pytest
import torch

from anytime.profile.latency import paused_gc, per_sample_latency


def test_timings_pause_the_garbage_collector():
    seen = []
    per_sample_latency({"probe": lambda x: seen.append(gc.isenabled())}, torch.zeros(4, 1), warmup=1)
    assert seen == [True] + [False] * 4  # the warm-up call runs with it, the four timed calls without
    assert gc.isenabled()
    with pytest.raises(ValueError), paused_gc():
        raise ValueError
    assert gc.isenabled()


def test_int8_weights_count_at_their_stored_size_not_as_the_float_they_report():
    import copy

    from torch import nn

    from anytime.profile.steps import weights_bytes
    from anytime.utils.quiet import quiet_torchao

    with quiet_torchao():
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    quantized = copy.deepcopy(model)
    quantize_(quantized, Int8DynamicActivationInt8WeightConfig())
    assert quantized[0].weight.dtype == torch.float32  # what the subclass reports
    dense = weights_bytes(model)
    assert dense == 4 * sum(p.numel() for p in model.parameters())
    assert dense / 4.2 < weights_bytes(quantized) < dense / 3.5  # int8 values, float scales and biases


def test_latency_turns_alternate_which_way_of_answering_goes_first():
    calls: list[tuple[str, float]] = []
    ticks = iter(range(1000))
    functions = {name: (lambda n: lambda x: calls.append((n, float(x[0, 0]))))(name) for name in ("a", "b")}
    inputs = torch.arange(5.0).reshape(5, 1)
    times = per_sample_latency(functions, inputs, warmup=0, turn=2, clock=lambda: float(next(ticks)))
    assert calls == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("b", 2), ("b", 3), ("a", 2), ("a", 3), ("a", 4), ("b", 4)]
    assert times["a"].tolist() == times["b"].tolist() == [1.0] * 5  # one tick between each start and its end
    with pytest.raises(ValueError, match="turn"):
        per_sample_latency(functions, inputs, turn=0)
