"""Benchmark: what an ONNX export of a multi-exit network costs, with the exporter's table shared or built per graph.

``torch.onnx.export`` builds its table of ATen-to-ONNX functions for every graph it writes; a multi-exit run is
exported as one graph per segment and per exit head. The export shares one table among its graphs and among the
exports that follow in the same process (:func:`anytime.deploy.onnx_export._one_onnx_table`). Side by side, in
alternating fresh processes, ROUNDS times each: the export as shipped, and the same with the table built for
every graph (the sharing turned off). Each process exports the network EXPORTS times. The model is a ResNet-20 with
exits after its first two stages at 32x32 (three segments and two heads: five graphs), random weights. Ratio: the
median seconds of a later export (the second and on) built per graph over shared. No target: a figure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from common import REPO, median, parser, report, run

from anytime.errors import AnytimeError

# Hyper-parameters
MODEL = "resnet20"
EXPORTS = 3  # per process; the first pays the imports
ROUNDS = 3  # fresh processes per variant (--quick: 1)

_CHILD = """
import contextlib, json, sys, tempfile, time
from pathlib import Path
import anytime.deploy.export as export
import anytime.deploy.onnx_export as onnx_export
from anytime.backbones import create_model
from anytime.families import attach_exits

if sys.argv[2] == "per-graph":
    onnx_export._one_onnx_table = contextlib.nullcontext
model = attach_exits(create_model(sys.argv[1], num_classes=10), "auto", num_classes=10, input_shape=(3, 32, 32)).eval()
seconds, graphs = [], 0
with tempfile.TemporaryDirectory() as scratch:
    for i in range(int(sys.argv[3])):
        folder = Path(scratch) / str(i)
        folder.mkdir()
        start = time.perf_counter()
        manifest = export.export_model(model, "onnx", "fp32", folder, input_shape=(3, 32, 32),
                                       labels=export.ManifestLabels("m", 10))
        seconds.append(time.perf_counter() - start)
        graphs = len(manifest.parts)
print(json.dumps({"seconds": seconds, "graphs": graphs}))
"""


def _export_times(variant: str, exports: int) -> dict[str, list[float] | int]:
    done = subprocess.run([sys.executable, "-c", _CHILD, MODEL, variant, str(exports)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)  # fmt: skip
    if done.returncode != 0:
        raise AnytimeError(f"the {variant} export failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    args = parser(__doc__.splitlines()[0]).parse_args()
    rounds = 1 if args.quick else ROUNDS
    first: dict[str, list[float]] = {"shared": [], "per-graph": []}
    later: dict[str, list[float]] = {"shared": [], "per-graph": []}
    graphs = 0
    for _ in range(rounds):
        for variant in ("per-graph", "shared"):
            measured = _export_times(variant, EXPORTS)
            seconds = list(measured["seconds"])  # type: ignore[arg-type]
            first[variant].append(seconds[0])
            later[variant].extend(seconds[1:])
            graphs = int(measured["graphs"])  # type: ignore[arg-type]
    print(
        f"{MODEL} with exits, {graphs} ONNX graphs per export, {rounds} process(es) per variant, {EXPORTS} exports each"
    )
    for variant in ("per-graph", "shared"):
        print(f"  {variant:<10} first export {median(first[variant]):6.2f} s   later exports {median(later[variant]):6.2f} s "
              f"(each: {', '.join(f'{s:.2f}' for s in later[variant])})")  # fmt: skip
    ratio = median(later["per-graph"]) / median(later["shared"])
    figures = {"model": MODEL, "graphs": graphs, "first_s": first, "later_s": later,
               "first_ratio": median(first["per-graph"]) / median(first["shared"])}  # fmt: skip
    return report("onnx_export_time", args, figures, ratio, "none (a figure)", None)


if __name__ == "__main__":
    run(main)
