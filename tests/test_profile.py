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
