"""What an export is: the formats and precisions anytime exports, the input dtype and the batch range of its
artifacts, the manifest that names, sizes and checksums them, and reading that manifest back, checked against the
files it names.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from anytime.deploy.runtimes import sha256_of
from anytime.errors import AnytimeError

FORMATS: tuple[str, ...] = ("pt2", "onnx")
EXPORTABLE: dict[str, tuple[str, ...]] = {"pt2": ("fp32", "int8", "bf16", "fp16"), "onnx": ("fp32", "int8")}
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "anytime-export-v1"
EXPORT = "export"  # the kind of results folder an export is
MAX_BATCH = 4096  # the largest batch an artifact's dynamic batch dimension admits
# an artifact's input dtype per precision (int8 artifacts take float images)
ARTIFACT_DTYPES = {"fp32": torch.float32, "int8": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dynamic_batch() -> tuple[dict[int, Any]]:
    """``torch.export``'s dynamic shapes for an artifact's one input: any batch from 1 to :data:`MAX_BATCH`."""
    return ({0: torch.export.Dim("batch", min=1, max=MAX_BATCH)},)


@dataclass(frozen=True)
class ArtifactPart:
    """One file of an export: a segment, an exit head, a step or the whole model."""

    file: str
    role: str  # segment | head | step | model
    step: int
    input_shape: tuple[int, ...]  # one sample's, without the batch dimension
    output_shape: tuple[int, ...]
    bytes: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record."""
        return {"file": self.file, "role": self.role, "step": self.step, "input_shape": list(self.input_shape),
                "output_shape": list(self.output_shape), "bytes": self.bytes, "sha256": self.sha256}  # fmt: skip

    @classmethod
    def from_dict(cls, doc: Any) -> ArtifactPart:
        """Rebuild from :meth:`to_dict` (a malformed record raises ``KeyError``/``TypeError``/``ValueError``)."""
        return cls(str(doc["file"]), str(doc["role"]), int(doc["step"]), tuple(int(v) for v in doc["input_shape"]),
                   tuple(int(v) for v in doc["output_shape"]), int(doc["bytes"]), str(doc["sha256"]))  # fmt: skip


@dataclass(frozen=True)
class ExportManifest:
    """What an export holds and where it came from; ``fingerprint`` names the artifacts' bytes (a profile of the
    export must name it), ``parent_fingerprint`` the run they were exported from."""

    format: str
    precision: str
    layout: str
    model: str
    num_classes: int
    input_shape: tuple[int, ...]
    step_flops: tuple[int, ...]
    parts: tuple[ArtifactPart, ...]
    parent_run: str
    parent_fingerprint: str
    created: str
    quantizer: str | None = None
    calibration_images: int | None = None
    versions: dict[str, str | None] = field(default_factory=dict)
    float_layers: tuple[str, ...] = ()  # int8: layers left in float

    @property
    def num_steps(self) -> int:
        """The number of steps the artifacts answer at."""
        return len(self.step_flops)

    @property
    def fingerprint(self) -> str:
        """A short SHA-256 over the artifacts' checksums, their format and precision."""
        digest = hashlib.sha256(f"{self.format}/{self.precision}".encode())
        for part in self.parts:
            digest.update(part.sha256.encode())
        return digest.hexdigest()[:16]

    @property
    def bytes(self) -> int:
        """The artifacts' total size on disk."""
        return sum(p.bytes for p in self.parts)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record (with its format tag)."""
        return {
            "format_tag": MANIFEST_FORMAT, "format": self.format, "precision": self.precision, "layout": self.layout,
            "model": self.model, "num_classes": self.num_classes, "input_shape": list(self.input_shape),
            "step_flops": list(self.step_flops), "parts": [p.to_dict() for p in self.parts],
            "parent_run": self.parent_run, "parent_fingerprint": self.parent_fingerprint,
            "fingerprint": self.fingerprint, "bytes": self.bytes, "created": self.created,
            "quantizer": self.quantizer, "calibration_images": self.calibration_images, "versions": self.versions,
            "float_layers": list(self.float_layers),
        }  # fmt: skip

    @classmethod
    def from_dict(cls, doc: Any, *, where: str) -> ExportManifest:
        """Rebuild from :meth:`to_dict`; anything malformed is a one-line error naming ``where``."""
        if not isinstance(doc, dict) or doc.get("format_tag") != MANIFEST_FORMAT:
            raise AnytimeError(f"{where} is not an anytime export manifest; export the run again with `anytime export`")
        try:
            manifest = cls(
                str(doc["format"]), str(doc["precision"]), str(doc["layout"]), str(doc["model"]),
                int(doc["num_classes"]), tuple(int(v) for v in doc["input_shape"]),
                tuple(int(v) for v in doc["step_flops"]), tuple(ArtifactPart.from_dict(p) for p in doc["parts"]),
                str(doc["parent_run"]), str(doc["parent_fingerprint"]), str(doc["created"]),
                doc.get("quantizer"), doc.get("calibration_images"), dict(doc.get("versions") or {}),
                tuple(str(name) for name in doc.get("float_layers") or ()),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError):
            raise AnytimeError(
                f"{where} is missing fields or has malformed ones; was it edited? Export the run again"
            ) from None
        if manifest.format not in FORMATS or manifest.precision not in EXPORTABLE[manifest.format]:
            raise AnytimeError(
                f"{where}: format '{manifest.format}' at precision '{manifest.precision}' is not one anytime exports"
            )
        expected = 2 * manifest.num_steps - 1 if manifest.layout == "exits" else manifest.num_steps
        if not manifest.parts or len(manifest.parts) != expected or manifest.num_steps < 1:
            raise AnytimeError(
                f"{where} lists {len(manifest.parts)} artifacts for {manifest.num_steps} steps; was it edited?"
            )
        if doc.get("fingerprint") not in (None, manifest.fingerprint):
            raise AnytimeError(f"{where}: the fingerprint does not match the artifacts' checksums; was it edited?")
        return manifest


def check_exportable(fmt: str, precision: str) -> None:
    """A one-line error for a format or a precision anytime does not export."""
    if fmt not in FORMATS:
        raise AnytimeError(f"unknown export format '{fmt}'; choose one of {', '.join(FORMATS)}")
    if precision not in EXPORTABLE[fmt]:
        raise AnytimeError(f"{fmt} artifacts are exported at {', '.join(EXPORTABLE[fmt])}, not {precision}")


def read_manifest(folder: str | os.PathLike[str]) -> ExportManifest:
    """The manifest of an export folder, checked against the files: each present, of its size and checksum."""
    root = Path(folder)
    path = root / MANIFEST
    if not root.is_dir():
        raise AnytimeError(f"no export at {folder}; write one with `anytime export RUN --format pt2 --out {folder}`")
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise AnytimeError(f"{folder} is not an export (no {MANIFEST}); write one with `anytime export`") from None
    except (OSError, ValueError):
        raise AnytimeError(f"{path} is not readable JSON; was it truncated? Export the run again") from None
    manifest = ExportManifest.from_dict(doc, where=str(path))
    for part in manifest.parts:
        file = root / part.file
        if Path(part.file).name != part.file or not file.is_file():
            raise AnytimeError(f"{file} is missing; the export is incomplete, export the run again")
        size = file.stat().st_size
        if size != part.bytes:
            raise AnytimeError(
                f"{file} has {size} bytes but the manifest says {part.bytes} (truncated or replaced); export the run again"
            )
        if sha256_of(file) != part.sha256:
            raise AnytimeError(
                f"{file} does not match its checksum in the manifest (changed since export); export the run again"
            )
    return manifest
