"""The serving worker's yield points: which modules get one, and when a yield happens (a fake clock and a counting
yield, so nothing here depends on the machine's scheduler)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from anytime.backbones.registry import create_model
from anytime.errors import AnytimeError
from anytime.families.exits import attach_exits
from anytime.serve.cooperate import BLOCK_WEIGHTS, YieldPoints, called_blocks, yield_blocks


class Clock:
    """Advances ``step`` seconds every time it is read."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def _block() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))


def test_blocks_are_the_outermost_modules_small_enough_and_lists_are_looked_into() -> None:
    big = nn.Sequential(*[_block() for _ in range(BLOCK_WEIGHTS)])  # 2 * BLOCK_WEIGHTS weights: too big for one
    model = nn.Sequential(big, nn.ModuleList([_block(), _block()]), nn.ReLU(), nn.Linear(4, 4))
    found = yield_blocks(model)
    assert found[:BLOCK_WEIGHTS] == list(big)  # split into its blocks, not into their layers
    assert found[BLOCK_WEIGHTS:] == [*model[1], model[3]]  # the list's items (a list is never called); no ReLU


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.script is deprecated, and still loaded by users
def test_a_small_model_is_one_block_and_opaque_parts_get_no_hook() -> None:
    small = _block()
    assert yield_blocks(small) == [small]
    scripted = torch.jit.script(nn.Sequential(*[_block() for _ in range(BLOCK_WEIGHTS)]))
    assert yield_blocks(nn.Sequential(scripted, *[_block() for _ in range(BLOCK_WEIGHTS)]))[0] is not scripted
    assert all(b is not scripted and b not in set(scripted.modules()) for b in yield_blocks(nn.ModuleList([scripted])))


def test_yields_come_once_every_interval_of_the_clock_and_the_hooks_go_with_the_context() -> None:
    model = nn.Sequential(*[_block() for _ in range(BLOCK_WEIGHTS)])  # BLOCK_WEIGHTS blocks, each hooked
    calls: list[float] = []
    clock = Clock(0.0003)  # each read advances 0.3 ms: a yield is due at every second block or so
    points = YieldPoints(model, 0.5, clock=clock, yield_cpu=lambda: calls.append(clock.now))
    with points:
        model(torch.zeros(1, 4))
    assert points.yields == len(calls) > 0
    assert all(b - a >= 0.0005 for a, b in zip(calls, calls[1:]))
    assert not any(m._forward_pre_hooks for m in model.modules())
    model(torch.zeros(1, 4))
    assert points.yields == len(calls)  # outside the context nothing yields


def test_zero_means_never() -> None:
    model = nn.Sequential(_block(), _block())
    with YieldPoints(model, 0, clock=Clock(1.0), yield_cpu=lambda: pytest.fail("yielded")) as points:
        model(torch.zeros(1, 4))
    assert points.yields == 0 and not any(m._forward_pre_hooks for m in model.modules())


def test_a_multi_exit_model_yields_in_the_segments_the_runtime_calls() -> None:
    model = attach_exits(create_model("resnet20"), "auto").eval()
    blocks = called_blocks(model)
    assert blocks and all(any(b is m for s in model.segments for m in s.modules()) for b in blocks)
    yields: list[int] = []
    with YieldPoints(model, 0.5, clock=Clock(0.001), yield_cpu=lambda: yields.append(1)), torch.inference_mode():
        model.forward_until(torch.zeros(1, 3, 32, 32), model.num_steps - 1)
    assert len(yields) == len(blocks)  # every block is 1 ms of this clock after the last yield


def test_the_service_refuses_a_negative_interval() -> None:
    from anytime.serve import Service

    with pytest.raises(AnytimeError, match="--yield-ms"):
        Service(SimpleNamespace(profile=SimpleNamespace(batch_sizes=(1,))), step_names=("a",), yield_ms=-1.0)  # type: ignore[arg-type]


def test_split_computing_server_refuses_the_http_servers_yield_option(tmp_path, capsys) -> None:
    from anytime.cli import main

    assert main(["serve", str(tmp_path), "--role", "server", "--yield-ms", "1"]) != 0
    err = capsys.readouterr().err.strip()
    assert "--yield-ms" in err and "apply to the HTTP server" in err and len(err.splitlines()) == 1
