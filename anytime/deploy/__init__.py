"""Deployable artifacts of any family's steps: inference forms (folded batch norm, channels-last), ONNX and pt2
exports with their manifest and runtimes, and exit policies compiled into the exported graphs."""
