"""Precision as a dimension of every step: int8 (PT2E static, per stage and head), int8-dynamic, bf16 and fp16
forms of any model under the step contract."""

from anytime.precision.model import PRECISIONS, Int8Recipe, PrecisionModel, PrecisionSpec, backend_for, convert

__all__ = ["PRECISIONS", "Int8Recipe", "PrecisionModel", "PrecisionSpec", "backend_for", "convert"]
