"""Serving a run over HTTP under deadlines (``anytime serve``): the queue and worker, inputs, metrics, the app."""

from __future__ import annotations

from anytime.utils.lazy import lazy_exports

_EXPORTS = {
    name: module
    for module, names in {
        "anytime.errors": ("BadRequest",),
        "anytime.serve.service": ("Answer", "Request", "Service", "parse_deadline"),
        "anytime.data.inputs": ("InputSpec",),
        "anytime.serve.metrics": ("Metrics",),
        "anytime.serve.http": ("ServeOptions", "build_app", "create_app", "serve"),
    }.items()
    for name in names
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
