"""Timings measured by TensorRT's ``trtexec`` on a board, fed back as a device profile of an ONNX export.

On the board, one engine per artifact of the export (``trtexec --onnx=segment0.onnx --fp16
--exportTimes=segment0.json ...``); the per-inference ``latencyMs`` of each (host-to-device copy, compute,
device-to-host copy) become the stage and step latencies the scheduler reads: for a multi-exit export, step
k costs segments 0..k plus head k, summed inference by inference; otherwise step k is artifact k.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from anytime.deploy.manifest import read_manifest
from anytime.errors import AnytimeError
from anytime.profile.store import BatchLatency, DeviceProfile


def _times(path: Path, field: str) -> np.ndarray:
    try:
        records = json.loads(path.read_text())
        values = np.asarray([float(r[field]) for r in records], dtype=np.float64)
    except FileNotFoundError:
        raise AnytimeError(
            f"{path} is missing: time each artifact with `trtexec --onnx=ARTIFACT --exportTimes={path.name}`"
        ) from None
    except (OSError, ValueError, KeyError, TypeError):
        raise AnytimeError(f"{path} is not trtexec's --exportTimes JSON (a list of records with '{field}')") from None
    if values.size == 0 or not np.all(np.isfinite(values)) or np.any(values < 0):
        raise AnytimeError(f"{path} holds no usable timings (empty, negative or not finite)")
    return values


def trtexec_profile(
    export_dir: str | Path, times_dir: str | Path, *, batch_size: int = 1, device_label: str = "TensorRT (trtexec)",
    field: str = "latencyMs", engine_precision: str | None = None,
) -> DeviceProfile:  # fmt: skip
    """A profile of ``export_dir`` (an ONNX export) from ``times_dir/<artifact stem>.json``, each the output of
    ``trtexec --exportTimes`` for that artifact's engine at ``batch_size``; ``engine_precision`` is what the
    engines were built for (``--fp16``, ``--int8``; default the export's own)."""
    manifest = read_manifest(export_dir)
    if manifest.format != "onnx":
        raise AnytimeError(
            f"{export_dir} holds {manifest.format} artifacts; trtexec builds engines from an ONNX export"
        )
    parts = [_times(Path(times_dir) / f"{Path(p.file).stem}.json", field) for p in manifest.parts]
    count = min(t.size for t in parts)
    parts = [t[:count] for t in parts]  # inference i of every engine makes repetition i
    incremental = manifest.layout == "exits" and manifest.num_steps > 1
    if incremental:
        last = manifest.num_steps - 1
        stages = tuple(parts[2 * k] + (parts[2 * k + 1] if k < last else 0) for k in range(manifest.num_steps))
        segments = np.cumsum([parts[2 * k] for k in range(manifest.num_steps)], axis=0)
        steps = tuple(segments[k] + (parts[2 * k + 1] if k < last else 0) for k in range(manifest.num_steps))
    else:
        stages, steps = None, tuple(parts)
    names = tuple(f"exit{k}" if manifest.layout == "exits" else f"step{k}" for k in range(manifest.num_steps))
    return DeviceProfile(
        model_fingerprint=manifest.fingerprint, model=f"{manifest.model} (onnx {manifest.precision}, trtexec)",
        input_shape=manifest.input_shape, incremental=incremental, step_names=names, step_flops=manifest.step_flops,
        step_params=(0,) * manifest.num_steps, model_bytes=manifest.bytes,
        latency={batch_size: BatchLatency(batch_size, steps, stages)},
        device={"type": "tensorrt", "label": device_label, "source": "trtexec --exportTimes"},
        settings={"repeats": count, "warmup": None, "threads": None, "seed": None, "inputs": "trtexec's",
                  "timer": f"trtexec {field}", "precision": {"precision": engine_precision or manifest.precision, "backend": "tensorrt",
                                                             "compile": True, "mode": "trtexec"}},
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )  # fmt: skip
