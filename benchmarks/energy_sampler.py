"""Benchmark: what a power-sampling energy reader costs the step it measures, and how long a figure takes.

The NVML reader of a GPU without an energy counter and the Jetson reader sample power from a thread (every 10 ms
and 5 ms) while an energy window runs the step; on a board with few cores that thread competes with the model,
so the step runs longer in an energy window than in a latency timing (where the thread never runs). This
machine has no energy source (a virtual machine: no RAPL, no NVML driver, no INA rails), so the probe here reads a
number from a file (open, read, parse: what a sysfs rail read does, though a real rail read also crosses the i2c
driver) and the reader integrates it exactly as on a board. Side by side, in alternating blocks: the last exit of a
multi-exit ResNet-32 (random weights, batch 1) timed with no sampling, and inside the reader's sampling block.
Ratio: p50 latency with the sampler / without. Target: <= 1.05 (the meter must not move what it measures by more
than 5%). Also reported: the wall time and calls per window of one energy figure at the default window settings.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import parser, report, run

from anytime.backbones.registry import create_model
from anytime.families import attach_exits
from anytime.profile.energy import EnergySettings, measure_energy
from anytime.profile.energy_readers import EnergySource, SampledPower

# Hyper-parameters
TARGET = 1.05  # p50 latency with the sampler / without
INTERVAL_S = 0.005  # the sampling period (the Jetson reader's; NVML's is 0.01)
BLOCKS = 20  # alternating blocks: without, with, without, ...
CALLS_PER_BLOCK = 200  # timed batch-1 forwards per block
THREADS = (1, 2)  # torch CPU threads: one, and one per core


def _reader(path: Path) -> SampledPower:
    source = EnergySource("file", f"{path}, sampled every {INTERVAL_S * 1000:g} ms", 1e-3, INTERVAL_S, True)
    return SampledPower(source, lambda: float(path.read_text()), interval_s=INTERVAL_S)


def _block(model: torch.nn.Module, x: torch.Tensor, last: int, calls: int) -> np.ndarray:
    out = np.empty(calls)
    for i in range(calls):
        start = time.perf_counter()
        model.forward_until(x, last)
        out[i] = time.perf_counter() - start
    return out * 1000


def main() -> int:
    args = parser(__doc__.splitlines()[0]).parse_args()
    blocks, calls = (4, 30) if args.quick else (BLOCKS, CALLS_PER_BLOCK)
    model = attach_exits(create_model("resnet32"), "auto").eval()
    last = model.num_steps - 1
    x = torch.randn(1, 3, 32, 32)
    figures: dict[str, object] = {"interval_s": INTERVAL_S, "blocks": blocks, "calls_per_block": calls}
    with tempfile.TemporaryDirectory() as folder, torch.inference_mode():
        rail = Path(folder) / "in_power0_input"
        rail.write_text("7.5\n")
        for threads in THREADS:
            torch.set_num_threads(threads)
            _block(model, x, last, 20)
            plain, sampled = [], []
            for b in range(blocks):
                if b % 2:
                    with _reader(rail).sampling():
                        sampled.append(_block(model, x, last, calls))
                else:
                    plain.append(_block(model, x, last, calls))
            a, s = np.concatenate(plain), np.concatenate(sampled)
            figures[f"threads_{threads}"] = {
                "plain_p50_ms": float(np.median(a)), "sampled_p50_ms": float(np.median(s)),
                "plain_p99_ms": float(np.quantile(a, 0.99)), "sampled_p99_ms": float(np.quantile(s, 0.99)),
                "p50_ratio": float(np.median(s) / np.median(a)), "p99_ratio": float(np.quantile(s, 0.99) / np.quantile(a, 0.99)),
            }  # fmt: skip
            f = figures[f"threads_{threads}"]
            print(f"{threads} thread(s): p50 {f['plain_p50_ms']:.3f} -> {f['sampled_p50_ms']:.3f} ms "  # type: ignore[index]
                  f"(x{f['p50_ratio']:.3f}), p99 {f['plain_p99_ms']:.3f} -> {f['sampled_p99_ms']:.3f} ms (x{f['p99_ratio']:.3f})")  # type: ignore[index]  # fmt: skip
        settings = EnergySettings(windows=3 if args.quick else EnergySettings().windows, idle_s=0)
        reader = _reader(rail)
        start = time.perf_counter()
        windows = measure_energy(lambda: model.forward_until(x, last), reader, 1, settings, what="the last exit")
        wall = time.perf_counter() - start
        reader.close()
    figures["one_figure"] = {"wall_s": wall, "windows": settings.windows, "calls_per_window": windows.calls,
                             "mean_j_per_inference": windows.mean_j}  # fmt: skip
    print(
        f"one energy figure at the default settings: {settings.windows} windows of {windows.calls} calls, {wall:.1f} s"
    )
    ratio = max(figures[f"threads_{t}"]["p50_ratio"] for t in THREADS)  # type: ignore[index]
    return report("energy_sampler", args, figures, ratio, f"<= {TARGET}", ratio <= TARGET)


if __name__ == "__main__":
    run(main)
