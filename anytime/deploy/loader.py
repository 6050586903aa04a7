"""Loading an export: its artifacts checked against the manifest, ``.pt2`` programs loaded without unpickling code
(int8 ones lowered to oneDNN kernels) or ONNX graphs run by ONNX Runtime sessions, under the step contract as an
:class:`ExportedModel`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from anytime.deploy.manifest import ARTIFACT_DTYPES, ExportManifest, read_manifest
from anytime.deploy.runtimes import PROVIDERS, ort_session
from anytime.errors import AnytimeError, first_line
from anytime.precision.int8 import lower_int8, x86_without_vnni
from anytime.precision.parts import PartsModel
from anytime.utils.quiet import quiet_torchao

if TYPE_CHECKING:
    from anytime.calibrate.policy import ExitPolicy
    from anytime.deploy.exit_program import ExitProgram


def _refuse_pickles(path: Path) -> None:
    """A ``.pt2`` archive stores tensor subclasses and custom objects as pickles; refuse those before loading."""
    try:
        with zipfile.ZipFile(path) as archive:
            for name in archive.namelist():
                if name.endswith("_config.json") and ("/weights/" in name or "/constants/" in name):
                    config = json.loads(archive.read(name)).get("config", {})
                    if any(entry.get("use_pickle") for entry in config.values()):
                        raise AnytimeError(
                            f"{path} holds pickled objects, which anytime never loads; export the run with anytime"
                        )
    except (zipfile.BadZipFile, ValueError, AttributeError):
        raise AnytimeError(f"{path} is not a readable .pt2 archive; export the run again") from None


@contextlib.contextmanager
def _weights_only() -> Iterator[None]:
    """Every ``torch.load`` inside (the archive's example inputs) refuses to unpickle code."""
    saved = {k: os.environ.get(k) for k in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _load_pt2(path: Path, precision: str) -> nn.Module:
    _refuse_pickles(path)
    if precision == "int8":  # registers the quantize/dequantize operators the int8 graphs call
        with quiet_torchao():
            import torchao.quantization.pt2e.quantize_pt2e  # noqa: F401
    logger = logging.getLogger("torch.export")
    level = logger.level
    logger.setLevel(logging.ERROR)  # a failed load logs the whole traceback as warnings; the error says it in one line
    try:
        with _weights_only():
            return torch.export.load(str(path)).module()
    except Exception as exc:  # noqa: BLE001
        raise AnytimeError(
            f"{path} could not be loaded as a .pt2 program ({first_line(exc)}); export the run again"
        ) from None
    finally:
        logger.setLevel(level)


class _OrtPart(nn.Module):
    """One ONNX artifact run by an ONNX Runtime session, as a module of tensors."""

    def __init__(self, session: Any) -> None:
        super().__init__()
        self.session = session
        self.input_name = session.get_inputs()[0].name

    def forward(self, x: Tensor) -> Tensor:
        array = np.ascontiguousarray(x.detach().cpu().numpy(), dtype=np.float32)
        return torch.from_numpy(self.session.run(None, {self.input_name: array})[0])


def onnxruntime_providers() -> tuple[str, ...]:
    """The execution providers of the installed ONNX Runtime build (none when it is not installed)."""
    try:
        import onnxruntime
    except ImportError:
        return ()
    return tuple(onnxruntime.get_available_providers())


class ExportedModel(PartsModel):
    """An export's artifacts under the step contract: ``.pt2`` programs (int8 lowered to oneDNN kernels unless
    ``lower=False``) or ONNX graphs run by ONNX Runtime. ``manifest`` says what they are."""

    def __init__(self, manifest: ExportManifest, parts: list[nn.Module], backend: str,
                 onnx: tuple[Path, str, int] | None = None) -> None:  # fmt: skip
        super().__init__(
            manifest.layout, parts, dtype=ARTIFACT_DTYPES[manifest.precision], step_flops=manifest.step_flops
        )
        self.manifest = manifest
        self.backend = backend
        self._onnx = onnx  # (folder, provider, threads) of ONNX artifacts
        self._programs: dict[ExitPolicy, ExitProgram | None] = {}

    @property
    def onnx_location(self) -> tuple[Path, str, int] | None:
        """Where ONNX artifacts are loaded from and how they run: (folder, provider, threads); ``None`` for .pt2."""
        return self._onnx

    def exit_program(self, policy: ExitPolicy) -> ExitProgram | None:
        """``policy`` compiled into this export's ONNX graphs (made on first use, then kept): what
        ``policy.run(self, x)`` runs; ``None`` where it cannot be compiled (see :func:`compile_policy`)."""
        if policy not in self._programs:
            from anytime.deploy.exit_program import compile_policy

            self._programs[policy] = compile_policy(self, policy)
        return self._programs[policy]

    @property
    def artifact_bytes(self) -> int:
        """The artifacts' size on disk (what a profile reports as the model's bytes)."""
        return self.manifest.bytes


def load_export(
    folder: str | os.PathLike[str], *, provider: str = "cpu", lower: bool = True, threads: int | None = None,
) -> ExportedModel:  # fmt: skip
    """Load an export's artifacts after checking them against the manifest; never unpickles code."""
    root = Path(folder)
    manifest = read_manifest(root)
    parts: list[nn.Module] = []
    if manifest.format == "pt2":
        if provider != "cpu":
            raise AnytimeError(".pt2 artifacts run through PyTorch here; --provider applies to ONNX artifacts")
        if manifest.precision == "int8" and lower and x86_without_vnni() and "7-bit" not in (manifest.quantizer or ""):
            raise AnytimeError(f"{root}'s int8 graphs were quantized for a CPU with VNNI (8-bit activations); this CPU has "
                               "none, so its int8 kernels would overflow: export the run again on this machine")  # fmt: skip
        for part in manifest.parts:
            module = _load_pt2(root / part.file, manifest.precision)
            if manifest.precision == "int8" and lower:
                module = lower_int8(module, torch.zeros(2, *part.input_shape))
            parts.append(module)
        backend = "torch (oneDNN int8)" if manifest.precision == "int8" and lower else "torch"
    else:
        count = threads or torch.get_num_threads()
        parts = [_OrtPart(ort_session(root / part.file, provider, count)) for part in manifest.parts]
        backend = f"onnxruntime ({PROVIDERS[provider]})"
        return ExportedModel(manifest, parts, backend, onnx=(root, provider, count))
    return ExportedModel(manifest, parts, backend)
