"""An early-exit policy compiled into a multi-exit ONNX export: one ONNX Runtime graph per exit that computes the
segment, the exit head, the policy's criterion and its decision, run on NumPy arrays from end to end.

On a small network every framework operation around the graphs costs about as much as a layer: at batch 1 a
LeNet answers in 88 us in ONNX Runtime, while scoring its logits with PyTorch operators, turning arrays into tensors
and entering inference mode cost 35 us more per answer. Here the decision is made inside the graph (in float64,
as :mod:`anytime.calibrate.criteria` makes it) and Python only reads one boolean per exit. With more than one
thread, a batch of 1 runs each graph on one thread where that measured faster when the policy was compiled.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from anytime.calibrate.criteria import get_criterion
from anytime.errors import AnytimeError

if TYPE_CHECKING:
    from anytime.calibrate.policy import ExitPolicy
    from anytime.deploy.loader import ExportedModel

_MIN_OPSET = 13  # ReduceSum takes its axes as an input from here on
_NUMPY_OF_ONNX = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}


@dataclass(frozen=True)
class ArrayAnswer:
    """Real early exit on a batch of arrays: each sample's predicted class, the exit it left at (both int64
    ``[N]``) and its float32 logits ``[N, C]``."""

    predictions: np.ndarray
    exits: np.ndarray
    logits: np.ndarray


@dataclass(frozen=True)
class _Graph:
    """One exit's ONNX Runtime sessions. ``decides``: it outputs (features, logits, leave, prediction); ``last``: it
    is the last exit's and outputs (logits, prediction); neither: a segment whose head nobody leaves at (features)."""

    session: Any
    one: Any  # the session for a batch of 1: ``session`` or, where it measured faster, a one-thread copy
    input_name: str
    decides: bool
    last: bool


_TRIALS = 15  # timed batch-1 runs of each thread count when choosing
_LARGE_S = 0.002  # a graph whose one-thread run at batch 1 takes longer keeps its threads untried


def _faster_alone(threaded: Any, single: Any, name: str, shape: tuple[int, ...], dtype: type,
                  clock: Callable[[], float] = time.perf_counter) -> bool:  # fmt: skip
    """Whether ``single`` (one thread) answers a batch of 1 faster than ``threaded``: median of interleaved runs.
    On a small graph waking a second thread for every operator costs more than the thread saves (a LeNet in
    ONNX Runtime at batch 1: about 0.185 ms with 2 threads, 0.127 ms with 1), on a large one it pays."""
    x: np.ndarray = np.zeros((1, *shape), dtype=dtype)
    for session in (threaded, single, threaded):
        session.run(None, {name: x})
    start = clock()
    single.run(None, {name: x})
    if clock() - start > _LARGE_S:
        return False  # a graph this long gains from threads: no trials (30 runs of a large graph take seconds)
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(2 * _TRIALS):
        session = (threaded, single)[i % 2]
        start = clock()
        session.run(None, {name: x})
        times[i % 2].append(clock() - start)
    return float(np.median(times[1])) < float(np.median(times[0]))


class ExitProgram:
    """A per-exit :class:`~anytime.calibrate.ExitPolicy` compiled into a multi-exit ONNX export (see
    :func:`compile_policy`). Call it on a float array ``[N, *input_shape]``; it answers like ``policy.run(model,
    x)``: the same exits and classes, the logits within float tolerance."""

    def __init__(self, graphs: list[_Graph], input_dtype: type) -> None:
        self._graphs = graphs
        self._dtype = input_dtype

    def __call__(self, x: np.ndarray) -> ArrayAnswer:
        if x.dtype != self._dtype or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=self._dtype)
        if x.shape[0] == 1:
            return self._one(x)
        return self._batch(x)

    def _one(self, x: np.ndarray) -> ArrayAnswer:
        # One sample: one boolean read per exit, nothing else (the latency path).
        h = x
        for k, graph in enumerate(self._graphs):  # noqa: B007 (k: the exit that answered, read after the loop)
            outputs = graph.one.run(None, {graph.input_name: h})
            if graph.last:
                logits, prediction = outputs
                break
            if not graph.decides:
                h = outputs[0]
                continue
            h, logits, leave, prediction = outputs
            if leave[0]:
                break
        return ArrayAnswer(prediction, np.array([k], dtype=np.int64), logits)

    def _batch(self, x: np.ndarray) -> ArrayAnswer:
        batch = x.shape[0]
        predictions = np.empty(batch, dtype=np.int64)
        exits = np.empty(batch, dtype=np.int64)
        out: np.ndarray | None = None
        index = np.arange(batch)
        h = x
        for k, graph in enumerate(self._graphs):
            outputs = graph.session.run(None, {graph.input_name: h})
            if not graph.last and not graph.decides:
                h = outputs[0]
                continue
            if graph.last:
                logits, prediction = outputs
                leave = np.ones(len(index), dtype=bool)
            else:
                h, logits, leave, prediction = outputs
            if out is None:
                out = np.empty((batch, logits.shape[1]), dtype=np.float32)
            gone = index[leave]
            predictions[gone], exits[gone], out[gone] = prediction[leave], k, logits[leave]
            if graph.last or leave.all():
                break
            stay = ~leave
            index, h = index[stay], h[stay]
        assert out is not None
        return ArrayAnswer(predictions, exits, out)


def compile_policy(model: ExportedModel, policy: ExitPolicy) -> ExitProgram | None:
    """``policy`` compiled into ``model``'s ONNX graphs, or ``None`` where it cannot be (a ``.pt2`` export, a
    stateful or combining policy, a graph ONNX cannot extend): run ``policy.run(model, x)`` there. The artifacts
    are checked against the manifest again first; a changed artifact is refused in one line."""
    from anytime.deploy.runtimes import onnx_modules, ort_session, sha256_of

    location = model.onnx_location
    crit = get_criterion(policy.criterion)
    if location is None or model.layout not in ("exits", "plain") or crit.stateful or policy.combine is not None:
        return None
    if policy.num_steps != model.num_steps:
        raise AnytimeError(f"this policy is for {policy.num_steps} exits; the model has {model.num_steps} exits")
    folder, provider, threads = location
    parts = [folder / part.file for part in model.manifest.parts]
    for path, part in zip(parts, model.manifest.parts):
        if sha256_of(path) != part.sha256:
            raise AnytimeError(f"{path} changed since the export was loaded; load the export again")
    onnx, _ = onnx_modules()
    temps = policy.temperatures or (1.0,) * policy.num_steps
    classes = model.manifest.num_classes
    graphs: list[_Graph] = []
    first: type = np.float32
    try:
        for k in range(model.num_steps):
            segment = onnx.load(str(parts[2 * k]))
            if k == model.num_steps - 1:
                graph = _answering(segment, None, policy.criterion, 1.0, None, classes)
            elif policy.thresholds[k] is None:
                graph = None  # the exported segment as it is
            else:
                head = onnx.load(str(parts[2 * k + 1]))
                graph = _answering(segment, head, policy.criterion, temps[k], policy.thresholds[k], classes)
            if graph is not None and not graph:
                return None
            session = ort_session(parts[2 * k], provider, threads, graph)
            name, kind = session.get_inputs()[0].name, session.get_inputs()[0].type
            dtype = _NUMPY_OF_ONNX.get(kind, np.float32)
            one = session
            if threads > 1 and provider == "cpu":
                single = ort_session(parts[2 * k], provider, 1, graph)
                shape = model.manifest.parts[2 * k].input_shape
                one = single if _faster_alone(session, single, name, shape, dtype) else session
            graphs.append(_Graph(session, one, name, graph is not None and k < model.num_steps - 1,
                                 k == model.num_steps - 1))  # fmt: skip
            if k == 0:
                first = dtype
    except Exception:  # noqa: BLE001 - ONNX cannot extend some graphs (e.g. other IR versions): the tensor path runs them
        return None
    return ExitProgram(graphs, first)


def _opset(model: Any) -> int:
    return max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)


def _answering(segment: Any, head: Any | None, criterion: str, temperature: float, threshold: float | None,
               num_classes: int) -> bytes:  # fmt: skip
    """One graph: ``segment`` then ``head`` (when given) with the criterion's decision appended. Outputs the
    segment's features, the float32 logits, ``leave`` (bool ``[N]``) and the predicted class (int64 ``[N]``); the
    last exit (no head) outputs the logits and the class. Empty bytes where the graph's opset is too old."""
    from onnx import TensorProto, compose, helper

    if _opset(segment) < _MIN_OPSET or (head is not None and _opset(head) < _MIN_OPSET):
        return b""
    if head is None:
        merged, features = segment, None
    else:
        head = compose.add_prefix(head, "exit_head/")
        features = segment.graph.output[0].name
        merged = compose.merge_models(segment, head, io_map=[(features, head.graph.input[0].name)],
                                      outputs=[features, head.graph.output[0].name])  # fmt: skip
    raw = merged.graph.output[-1].name
    g = merged.graph
    nodes = [helper.make_node("Cast", [raw], ["policy/logits"], to=TensorProto.FLOAT),
             helper.make_node("ArgMax", ["policy/logits"], ["policy/prediction"], axis=1, keepdims=0)]  # fmt: skip
    outputs = [helper.make_tensor_value_info("policy/logits", TensorProto.FLOAT, None),
               helper.make_tensor_value_info("policy/prediction", TensorProto.INT64, None)]  # fmt: skip
    if head is not None:
        assert threshold is not None
        nodes += _decision(criterion, temperature, threshold, num_classes, g)
        outputs.insert(1, helper.make_tensor_value_info("policy/leave", TensorProto.BOOL, None))
        outputs.insert(0, next(o for o in g.output if o.name == features))
    del g.output[:]
    g.output.extend(outputs)
    g.node.extend(nodes)
    return merged.SerializeToString()


def _decision(criterion: str, temperature: float, threshold: float, num_classes: int, g: Any) -> list[Any]:
    """The nodes scoring ``policy/logits`` in float64 and comparing the score with ``threshold``."""
    from onnx import TensorProto, helper

    def const(name: str, value: float | list[int], dtype: int = TensorProto.DOUBLE) -> str:
        dims: list[int] = [len(value)] if isinstance(value, list) else []
        values: list[float] | list[int] = value if isinstance(value, list) else [value]  # a list: 1-D, else a scalar
        g.initializer.append(helper.make_tensor(f"policy/{name}", dtype, dims, values))
        return f"policy/{name}"

    nodes = [helper.make_node("Cast", ["policy/logits"], ["policy/z64"], to=TensorProto.DOUBLE)]
    z = "policy/z64"
    if temperature != 1.0:
        nodes.append(helper.make_node("Div", [z, const("temperature", temperature)], ["policy/z"]))
        z = "policy/z"
    nodes.append(helper.make_node("Softmax", [z], ["policy/p"], axis=-1))
    limit = const("threshold", threshold)
    if criterion in ("entropy", "normalized-entropy"):
        # -sum p log p, with log p from LogSoftmax so a probability that underflows to 0 adds 0 (as torch's entr)
        nodes += [helper.make_node("LogSoftmax", [z], ["policy/logp"], axis=-1),
                  helper.make_node("Mul", ["policy/p", "policy/logp"], ["policy/plogp"]),
                  helper.make_node("ReduceSum", ["policy/plogp", const("axes", [-1], TensorProto.INT64)],
                                   ["policy/negentropy"], keepdims=0),
                  helper.make_node("Neg", ["policy/negentropy"], ["policy/score"])]  # fmt: skip
        if criterion == "normalized-entropy":
            nodes[-1].output[0] = "policy/entropy"
            nodes.append(helper.make_node("Div", ["policy/entropy", const("log_classes", math.log(num_classes))],
                                          ["policy/score"]))  # fmt: skip
        nodes.append(helper.make_node("LessOrEqual", ["policy/score", limit], ["policy/leave"]))
        return nodes
    nodes.append(helper.make_node("TopK", ["policy/p", const("k", [2 if criterion == "margin" else 1], TensorProto.INT64)],
                                  ["policy/top", "policy/top_index"], axis=-1))  # fmt: skip
    first = const("first", [0], TensorProto.INT64)
    end = const("one", [1], TensorProto.INT64)
    axis = const("axis", [1], TensorProto.INT64)
    nodes.append(helper.make_node("Slice", ["policy/top", first, end, axis], ["policy/top1"]))
    if criterion == "margin":
        nodes.append(helper.make_node("Slice", ["policy/top", end, const("two", [2], TensorProto.INT64), axis],
                                      ["policy/top2"]))  # fmt: skip
        nodes.append(helper.make_node("Sub", ["policy/top1", "policy/top2"], ["policy/margin"]))
        top = "policy/margin"
    else:
        top = "policy/top1"
    nodes.append(helper.make_node("Squeeze", [top, axis], ["policy/score"]))
    nodes.append(helper.make_node("GreaterOrEqual", ["policy/score", limit], ["policy/leave"]))
    return nodes


__all__ = ["ArrayAnswer", "ExitProgram", "compile_policy"]
