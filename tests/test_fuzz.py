"""Property-based tests (Hypothesis) of every parser of outside input: whatever bytes or values arrive, the answer
is the parsed value or the framework's one-sentence error (``AnytimeError``, ``BadRequest`` for the server,
``ValueError`` where the split link's protocol says so), never another exception. Examples are generated, not
timed: no deadline, so a busy machine cannot fail them."""

from __future__ import annotations

import io
import json
import socket
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anytime.calibrate import ExitPolicy
from anytime.calibrate.gates import ExitGates
from anytime.data.inputs import InputSpec
from anytime.errors import AnytimeError, BadRequest
from anytime.outputs import OutputCache
from anytime.profile.store import DeviceProfile
from anytime.serve.http import _json_fields, _multipart_fields
from anytime.serve.service import parse_deadline, parse_energy_budget
from anytime.split.codec import decode
from anytime.split.link import PREFIX, read_frame
from anytime.utils.jsonsafe import loads_bounded

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SPEC = InputSpec(1, 8, 8, (0.5,), (0.25,))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=30,
)


@FUZZ
@given(st.binary(max_size=2000) | st.text(alphabet='[]{}"\\,:01 a', max_size=3000).map(str.encode))
def test_bounded_json_parses_or_says_why_in_one_sentence(body):
    try:
        loads_bounded(body)
    except ValueError as exc:
        assert "\n" not in str(exc)


@FUZZ
@given(st.integers(1, 100_000))
def test_deep_json_is_refused_before_any_recursion(depth):
    body = b"[" * depth + b"]" * depth
    if depth <= 64:
        assert loads_bounded(body) is not None
    else:
        with pytest.raises(ValueError, match="levels deep"):
            loads_bounded(body)


def _npy(shape: tuple[int, ...], dtype: str, declared: str | None) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.zeros(shape, dtype=dtype), allow_pickle=False)
    body = buffer.getvalue()
    if declared is not None:  # a header that lies about the size
        body = body.replace(repr(shape).encode(), declared.encode(), 1)
    return body


image_bodies = (
    st.binary(max_size=3000)
    | st.binary(max_size=500).map(lambda b: b"\x89PNG\r\n\x1a\n" + b)
    | st.binary(max_size=500).map(lambda b: b"\xff\xd8\xff" + b)
    | st.binary(max_size=500).map(lambda b: b"\x93NUMPY" + b)
    | st.builds(_npy, st.lists(st.integers(1, 9), min_size=1, max_size=4).map(tuple),
                st.sampled_from(["uint8", "float32", "float64", "int64", "bool"]),
                st.none() | st.sampled_from(["(1000000000000000000,)", "(8, 8, 999999999)", "(-1,)", "()"]))
)  # fmt: skip


@FUZZ
@given(image_bodies)
def test_an_image_request_decodes_to_the_input_or_is_a_bad_request(body):
    try:
        x = SPEC.decode(body)
    except BadRequest as exc:
        assert 400 <= exc.status < 500 and "\n" not in str(exc)
    else:
        assert tuple(x.shape) == (1, 8, 8) and bool(x.isfinite().all())


@FUZZ
@given(st.binary(max_size=3000), st.text(max_size=40))
def test_a_form_or_json_body_parses_or_is_a_bad_request(body, boundary):
    for parse in (lambda: _multipart_fields(body, f"multipart/form-data; boundary={boundary}", "image"),
                  lambda: _json_fields(body, "text")):  # fmt: skip
        try:
            fields = parse()
        except BadRequest as exc:
            assert 400 <= exc.status < 500
        else:
            assert all(isinstance(k, str) and isinstance(v, bytes) for k, v in fields.items())


@FUZZ
@given(st.none() | st.text(max_size=30))
def test_deadlines_and_energy_budgets_parse_or_are_bad_requests(text):
    for parse in (parse_deadline, parse_energy_budget):
        try:
            value = parse(text)
        except BadRequest as exc:
            assert exc.status == 400
        else:
            assert value is None or (value > 0 and np.isfinite(value))


@FUZZ
@given(json_values, st.binary(max_size=300))
def test_split_frames_decode_or_are_refused(fields, payload):
    try:
        decode(fields if isinstance(fields, dict) else {"codec": fields, "shape": fields}, payload)
    except AnytimeError as exc:
        assert "\n" not in str(exc)


@FUZZ
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.binary(max_size=400))
def test_the_split_link_reads_a_frame_or_refuses_it(head_len, payload_len, rest):
    left, right = socket.socketpair()
    try:
        right.sendall(PREFIX.pack(head_len, payload_len)[: PREFIX.size] + rest)
        right.shutdown(socket.SHUT_WR)
        try:
            header, payload = read_frame(left, max_payload=1000)
        except (ValueError, ConnectionError):
            pass
        else:
            assert isinstance(header, dict) and len(payload) == payload_len
    finally:
        left.close()
        right.close()
    assert PREFIX.size == struct.calcsize(PREFIX.format)


@FUZZ
@given(json_values)
def test_run_records_of_policies_gates_and_profiles_load_or_are_refused(doc):
    documents = [
        doc,
        {"criterion": "learned", "thresholds": [0.5], "gates": doc},
        {"criterion": doc, "thresholds": doc},
    ]
    for document in documents:
        for load in (ExitPolicy.from_dict, ExitGates.from_dict, DeviceProfile.from_dict):
            try:
                load(document)
            except AnytimeError as exc:
                assert "\n" not in str(exc)


@FUZZ
@given(st.binary(max_size=2000))
def test_a_damaged_outputs_cache_is_refused(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("cache") / "val.npz"
    path.write_bytes(b"PK\x03\x04" + data if data[:1] == b"\x00" else data)
    with pytest.raises(AnytimeError):
        OutputCache.load(path)


def test_the_suite_sees_real_values_too():
    # The properties above would pass vacuously if every example were refused: a valid input of each kind parses.
    assert loads_bounded(json.dumps({"a": [1, 2]}).encode()) == {"a": [1, 2]}
    assert tuple(SPEC.decode(_npy((1, 8, 8), "uint8", None)).shape) == (1, 8, 8)
    assert parse_deadline("12.5") == 12.5
