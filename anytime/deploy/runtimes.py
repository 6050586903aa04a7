"""What loading and checking an exported artifact needs on both sides of an export: the file digests, the ONNX
libraries and an ONNX Runtime session configured as the runtime uses it."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from anytime.errors import AnytimeError, first_line

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}
DEPLOY_HINT = "pip install 'anytime[deploy]' (onnx, onnxscript, onnxruntime)"


def sha256_of(path: Path) -> str:
    """The full SHA-256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def onnx_modules() -> tuple[Any, Any]:
    """``onnx`` and ``onnxruntime``, imported here (refused in one line where they are not installed)."""
    try:
        import onnx
        import onnxruntime
    except ImportError:
        raise AnytimeError(
            f"ONNX artifacts need onnx and onnxruntime, which are not installed; {DEPLOY_HINT}"
        ) from None
    return onnx, onnxruntime


def ort_session(path: Path, provider: str, threads: int, graph: bytes | None = None) -> Any:
    """An ONNX Runtime session of ``path`` (or of the serialized ``graph``, made from ``path``)."""
    _, ort = onnx_modules()
    wanted = PROVIDERS.get(provider)
    if wanted is None:
        raise AnytimeError(f"unknown ONNX Runtime provider '{provider}'; choose one of {', '.join(PROVIDERS)}")
    available = ort.get_available_providers()
    if wanted not in available:
        raise AnytimeError(f"ONNX Runtime here has no {wanted} (it has {', '.join(available)}); install the onnxruntime build "
                           "for that device, or run with the cpu provider")  # fmt: skip
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    # ONNX Runtime's threads spin after each run by default, taking the cores from whatever runs next in this
    # process (PyTorch steps timed beside it, a server's other work); they sleep instead
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(graph if graph is not None else str(path), options,
                                    providers=list(dict.fromkeys([wanted, "CPUExecutionProvider"])))  # fmt: skip
    except Exception as exc:  # noqa: BLE001
        raise AnytimeError(f"ONNX Runtime could not load {path} ({first_line(exc)}); export the run again") from None
