"""`anytime serve`: the queue and its deadline accounting (driven by a fake clock), and the HTTP endpoint on a
trained, profiled digits run (real requests on 127.0.0.1, no timing assertions)."""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import shutil
import socket
import threading
import uuid
from collections.abc import Iterator
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from anytime.errors import AnytimeError
from anytime.scheduler import AnytimePrediction, DriftEstimator
from anytime.serve import InputSpec, Request, Service

# ---------------------------------------------------------------- the queue, with a fake clock


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class StubModel(nn.Module):
    """Two steps; step k answers class k + 1 for every sample."""

    num_steps = 2

    def forward_until(self, x: torch.Tensor, k: int) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.full((x.shape[0],), k + 1), 4).float()

    def steps(self, x: torch.Tensor) -> Iterator[torch.Tensor]:
        return (self.forward_until(x, k) for k in range(self.num_steps))

    def forward_all(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack(list(self.steps(x)))


class StubRunner:
    """Takes ``compute_s`` of the fake clock per batch and answers at step 1 (sample 0 left at step 0)."""

    def __init__(self, clock: FakeClock, compute_s: float = 0.002) -> None:
        self.clock, self.compute_s = clock, compute_s
        self.profile = SimpleNamespace(batch_sizes=(1, 4))
        self.drift = DriftEstimator()
        self.model = StubModel()
        self.budgets: list[float] = []
        self.energy_budgets: list[float | None] = []

    def predict(self, x: torch.Tensor, deadline_ms: float, energy_mj: float | None = None) -> AnytimePrediction:
        self.budgets.append(deadline_ms)
        self.energy_budgets.append(energy_mj)
        self.clock.now += self.compute_s
        exits = torch.ones(x.shape[0], dtype=torch.long)
        exits[0] = 0
        return AnytimePrediction(exits + 1, torch.zeros(x.shape[0], 4), exits, 1, "deadline", 2.0, deadline_ms)


def _service(clock: FakeClock, **kwargs) -> tuple[Service, StubRunner]:
    runner = StubRunner(clock)
    return Service(
        runner, step_names=("exit0", "exit1"), class_names=("a", "b", "c", "d"), clock=clock, **kwargs
    ), runner  # type: ignore[arg-type]


def test_time_in_the_queue_counts_against_the_deadline():
    clock = FakeClock()
    service, runner = _service(clock)
    image = torch.zeros(1, 8, 8)
    first = Request(image, 10.0, arrived=0.0)
    second = Request(image, 20.0, arrived=0.001)
    clock.now = 0.003  # the worker gets to them 3 ms after the first arrived
    a, b = service.answer_now([first, second])
    assert runner.budgets == [pytest.approx(7.0)]  # the tightest deadline left in the batch
    assert (a.queued_ms, a.compute_ms, a.total_ms) == (pytest.approx(3.0), pytest.approx(2.0), pytest.approx(5.0))
    assert a.met and a.step == 0 and a.reason == "confident" and a.label == 1 and a.class_name == "b"
    assert b.queued_ms == pytest.approx(2.0) and b.step == 1 and b.reason == "deadline" and b.batch_size == 2


def test_a_request_whose_deadline_passed_in_the_queue_is_answered_at_once_as_missed():
    clock = FakeClock()
    service, runner = _service(clock)
    late = Request(torch.zeros(1, 8, 8), 5.0, arrived=0.0)
    cheap = Request(torch.zeros(1, 8, 8), 5.0, arrived=0.0, cheapest=True)
    on_time = Request(torch.zeros(1, 8, 8), 50.0, arrived=0.0)
    clock.now = 0.006
    gone, cheapest, fine = service.answer_now([late, cheap, on_time])
    assert gone.reason == "expired" and gone.label is None and gone.step is None and not gone.met
    assert cheapest.reason == "expired" and cheapest.step == 0 and cheapest.label == 1 and not cheapest.met
    assert fine.met and runner.budgets == [pytest.approx(44.0)]  # the expired ones did not tighten the batch
    text = service.metrics.render(service.queue_depth)
    assert "anytime_requests_total 3" in text and "anytime_deadline_misses_total 2" in text
    assert "anytime_expired_total 2" in text and 'anytime_request_seconds_count{step="exit0"}' in text
    # Only the request the runtime ran was promised (its option fitted); the expired ones were not.
    assert "anytime_promised_total 1" in text and "anytime_promises_broken_total 0" in text
    assert fine.fits and not gone.fits and fine.to_dict()["fits"] is True


def test_a_batch_runs_under_the_tightest_energy_budget_among_its_requests():
    clock = FakeClock()
    service, runner = _service(clock)
    image = torch.zeros(1, 8, 8)
    service.answer_now([Request(image, 10.0, arrived=0.0, energy_mj=30.0), Request(image, 10.0, arrived=0.0),
                        Request(image, 10.0, arrived=0.0, energy_mj=12.0)])  # fmt: skip
    service.answer_now([Request(image, 10.0, arrived=0.0)])
    assert runner.energy_budgets == [12.0, None]


def test_the_worker_answers_in_batches_and_never_loses_a_request():
    clock = FakeClock()
    service, runner = _service(clock, max_batch=4)
    futures = [service.submit(Request(torch.zeros(1, 8, 8), 1e6, arrived=0.0)) for _ in range(10)]
    service.start()
    answers = [f.result(timeout=30) for f in futures]
    service.stop()
    assert all(a.met for a in answers) and sum(1 for _ in runner.budgets) >= 3  # 10 requests, at most 4 at a time
    assert max(a.batch_size for a in answers) <= 4


def test_the_service_refuses_batches_the_profile_never_measured():
    with pytest.raises(AnytimeError, match="larger than any batch size the profile measured"):
        _service(FakeClock(), max_batch=8)
    service, _ = _service(FakeClock())
    assert service.max_batch == 4  # default: the largest profiled batch, up to 8


# ---------------------------------------------------------------- the HTTP endpoint on a real run


def _png(array: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)
    return buffer.getvalue()


def _png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` pixels (its one data chunk holds a few bytes)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


def _npy_declaring(shape: tuple[int, ...]) -> bytes:
    """An ``.npy`` header declaring float32 data of ``shape``, followed by a few bytes."""
    from numpy.lib import format as npy

    buffer = io.BytesIO()
    npy.write_array_header_1_0(buffer, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return buffer.getvalue() + b"\0" * 64


@pytest.fixture(scope="module")
def server(exit_run, tmp_path_factory):
    """`anytime serve` of a calibrated, profiled digits run, on a free port of 127.0.0.1."""
    from anytime.serve import ServeOptions, build_app
    from anytime.tasks.calibration import CalibrationSettings, calibrate_run
    from anytime.tasks.collect import collect_run
    from anytime.tasks.profiling import ProfileSettings, profile_run

    run = tmp_path_factory.mktemp("served") / "run"
    shutil.copytree(exit_run, run)
    collect_run(run, "val")
    calibrate_run(run, CalibrationSettings(max_drop=1.0, criterion="confidence"))
    profile_run(run, ProfileSettings(batch_sizes=(1, 2), repeats=100, warmup=2, memory=False))
    app, service = build_app(ServeOptions(run=str(run), max_body_kb=64, quantile=0.9))
    with listening(app, service) as port:
        yield SimpleNamespace(port=port, run=run, service=service)


@contextlib.contextmanager
def listening(app, service):
    """Serve ``app`` on a free port of 127.0.0.1 in a thread; yield the port; stop the server and ``service``."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from anytime.serve.http import SERVER_SETTINGS

    instance = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", **SERVER_SETTINGS))
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    for _ in range(600):
        if instance.started:
            break
        threading.Event().wait(0.05)
    assert instance.started, "the server did not start"
    try:
        yield port
    finally:
        instance.should_exit = True
        thread.join(timeout=30)
        service.stop()


def _call(server, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request(method, path, body=body, headers=headers or {})
    response = conn.getresponse()
    raw = response.read()
    conn.close()
    kind = response.getheader("content-type", "")
    return response.status, json.loads(raw) if kind.startswith("application/json") else raw.decode()


def _multipart(fields: dict[str, bytes]) -> tuple[bytes, dict[str, str]]:
    boundary = uuid.uuid4().hex
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"{"; filename=x.png" if name == "image" else ""}'
             f"\r\n\r\n".encode() + value + b"\r\n" for name, value in fields.items()]  # fmt: skip
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), {
        "Content-Type": f"multipart/form-data; boundary={boundary}"
    }


def test_predict_accepts_images_arrays_and_forms_with_the_deadline_anywhere(server):
    digit = (np.arange(1024).reshape(32, 32) % 256).astype(np.uint8)
    spec = InputSpec.from_dataset(json.loads((server.run / "config.json").read_text())["dataset"])
    normalised = spec.decode(_npy(digit)).numpy()
    body, headers = _multipart({"image": _png(digit), "deadline_ms": b"1000"})
    requests = [
        ("/predict?deadline_ms=1000", _png(digit), {}),
        ("/predict", _npy(digit), {"X-Deadline-Ms": "1000"}),
        ("/predict?deadline_ms=1000", _npy(normalised), {}),
        ("/predict", body, headers),
    ]
    answers = []
    for path, payload, extra in requests:
        status, answer = _call(server, "POST", path, payload, extra)
        assert status == 200, answer
        answers.append(answer)
    # The same digit as PNG, uint8 array, normalised float array and form: the same class.
    assert len({a["class"] for a in answers}) == 1 and all(0 <= a["class"] <= 9 for a in answers)
    for a in answers:
        assert a["met"] and a["reason"] in ("confident", "deadline", "last") and a["step_name"].startswith("exit")
        assert a["total_ms"] >= a["queued_ms"] >= 0 and a["compute_ms"] >= 0 and a["deadline_ms"] == 1000


def test_a_deadline_already_gone_is_answered_as_missed_with_the_cheapest_answer_if_asked(server):
    digit = np.zeros((32, 32), np.uint8)
    status, missed = _call(server, "POST", "/predict?deadline_ms=0.000001", _png(digit))
    assert status == 200 and missed["reason"] == "expired" and missed["class"] is None and not missed["met"]
    status, cheap = _call(server, "POST", "/predict?deadline_ms=0.000001&cheapest=1", _png(digit))
    assert status == 200 and cheap["reason"] == "expired" and cheap["step"] == 0 and cheap["class"] is not None


@pytest.mark.parametrize("method,path,body,headers,status,words", [
    ("POST", "/predict?deadline_ms=5", b"\x00garbage", {}, 415, "neither a readable PNG"),
    ("POST", "/predict?deadline_ms=5", "PNG16", {}, 400, "32x32 grayscale"),
    ("POST", "/predict?deadline_ms=5", "RGB", {}, 400, "32x32 grayscale"),
    ("POST", "/predict?deadline_ms=5", "NPY3", {}, 400, "shape [3, 3]"),
    ("POST", "/predict?deadline_ms=5", "OBJECT", {}, 400, "object array"),
    ("POST", "/predict?deadline_ms=5", "NANARRAY", {}, 400, "NaN"),
    ("POST", "/predict", "PNG", {"X-Deadline-Ms": "nan"}, 400, "finite positive"),
    ("POST", "/predict", "PNG", {}, 400, "no deadline"),
    ("POST", "/predict?deadline_ms=-3", "PNG", {}, 400, "finite positive"),
    ("POST", "/predict?deadline_ms=5", b"\0" * (65 * 1024), {}, 413, "limit"),
    ("POST", "/predict?deadline_ms=5", b"", {}, 400, "empty request"),
    ("GET", "/predict", b"", {}, 405, "not allowed"),
    ("GET", "/../../etc/passwd", b"", {}, 404, "no route"),
    ("GET", "/docs", b"", {}, 404, "no route"),
    ("GET", "/schedule?deadline_ms=abc", b"", {}, 400, "not a number"),
    ("GET", "/schedule?deadline_ms=5&quantile=3", b"", {}, 400, "quantile"),
    ("POST", "/predict?deadline_ms=5&energy_mj=nan", "PNG", {}, 400, "finite positive number of millijoules"),
    ("POST", "/predict?deadline_ms=5", "PNG", {"X-Energy-Mj": "lots"}, 400, "not a number of millijoules"),
    ("POST", "/predict?deadline_ms=5&energy_mj=3", "PNG", {}, 400, "no energy figures"),
    ("GET", "/schedule?deadline_ms=5&energy_mj=-1", b"", {}, 400, "finite positive number of millijoules"),
    ("GET", "/schedule?deadline_ms=5&energy_mj=3&quantile=0.9", b"", {}, 400, "no energy figures"),
    ("POST", "/predict?deadline_ms=5", "BOMB", {}, 413, "far more pixels"),
    ("POST", "/predict?deadline_ms=5", "HUGENPY", {}, 400, "shape [1000000000000000000]"),
    ("POST", "/predict?deadline_ms=5", "TIBNPY", {}, 400, "shape [1024, 1024, 1024, 1024]"),
    ("POST", "/predict?deadline_ms=5", "SHORTNPY", {}, 400, "truncated"),
    ("POST", "/predict", b"[" * 60_000, {"Content-Type": "application/json"}, 400, "nests 60000 levels"),
    ("POST", "/predict", b'{"deadline_ms": 5, "x": ' + b"[" * 100 + b"]" * 100 + b"}",
     {"Content-Type": "application/json"}, 400, "nests 101 levels"),
    ("POST", "/predict", "MANYPARTS", {"Content-Type": "multipart/form-data; boundary=b"}, 400, "parts"),
    ("POST", "/predict?deadline_ms=5", "PNG", {"Content-Type": "text/plain"}, 415, "not an image"),
])  # fmt: skip
def test_bad_requests_get_a_4xx_sentence_and_the_server_keeps_serving(
    server, method, path, body, headers, status, words
):
    made = {
        "PNG": _png(np.zeros((32, 32), np.uint8)), "PNG16": _png(np.zeros((16, 16), np.uint8)),
        "RGB": _png(np.zeros((32, 32, 3), np.uint8)), "NPY3": _npy(np.zeros((3, 3), np.uint8)),
        "OBJECT": _npy(np.array([{"a": 1}], dtype=object)), "NANARRAY": _npy(np.full((1, 32, 32), np.nan, np.float32)),
        "BOMB": _png_declaring(30000, 30000), "HUGENPY": _npy_declaring((10**18,)),
        "TIBNPY": _npy_declaring((1024,) * 4), "SHORTNPY": _npy(np.zeros((32, 32), np.uint8))[:-100],
        "MANYPARTS": b"".join(b"--b\r\nContent-Disposition: form-data; name=p\r\n\r\nx\r\n" for _ in range(1000)) + b"--b--",
    }  # fmt: skip
    got, answer = _call(server, method, path, made.get(body, body) if isinstance(body, str) else body, headers)
    assert got == status and isinstance(answer, dict) and words in answer["error"], answer
    assert "\n" not in answer["error"] and "Traceback" not in answer["error"]
    ok, good = _call(server, "POST", "/predict?deadline_ms=1000", made["PNG"])
    assert ok == 200 and good["class"] is not None


def test_an_oversized_body_is_answered_413_even_to_a_client_still_sending_it(server):
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{server.port}/predict?deadline_ms=5", data=b"\0" * (512 << 10),
                                     method="POST")  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 413 and "limit" in json.loads(refused.value.read())["error"]


def test_a_stalled_client_is_cut_off_and_does_not_hold_the_server(server, monkeypatch):
    import anytime.serve.http as served
    from anytime.serve.protocol import HeaderDeadline

    monkeypatch.setattr(served, "BODY_TIMEOUT_S", 0.5)
    monkeypatch.setattr(HeaderDeadline, "header_timeout_s", 0.5)
    silent = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    half = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    half.sendall(b"POST /predict?deadline_ms=5 HTTP/1.1\r\nHost: x\r\nContent-Le")
    short = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    short.sendall(b"POST /predict?deadline_ms=5 HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"\0" * 10)
    ok, good = _call(server, "POST", "/predict?deadline_ms=1000", _png(np.zeros((32, 32), np.uint8)))
    assert ok == 200 and good["class"] is not None  # served while three connections stall
    for sock in (silent, half):
        assert sock.recv(1024) == b""  # closed by the server, without an answer to a request never finished
        sock.close()
    chunks = [short.recv(4096)]
    while chunks[-1]:  # the headers and the body may arrive in separate reads; the server closes after its answer
        chunks.append(short.recv(4096))
    short.close()
    reply = b"".join(chunks).decode()
    assert reply.startswith("HTTP/1.1 408") and "did not arrive within 0.5 s" in reply


@pytest.mark.parametrize("argv,words", [
    (["--port", "70000"], ("--port 70000", "0-65535")),
    (["--host", "256.1.1.1"], ("--host 256.1.1.1",)),
    (["--port", "BUSY"], ("cannot listen", "choose another")),
])  # fmt: skip
def test_serve_refuses_an_address_it_cannot_listen_on_before_saying_serving(exit_run, cli_error, capsys, argv, words):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        argv = [str(busy.getsockname()[1]) if a == "BUSY" else a for a in argv]
        cli_error(["serve", str(exit_run), *argv], *words)


def test_schedule_healthz_and_metrics(server):
    from anytime.scheduler.query import schedule_answer, scheduler_for_run

    status, answer = _call(server, "GET", "/schedule?deadline_ms=1000&quantile=0.9")
    scheduler, path = scheduler_for_run(server.run)
    expected = {**schedule_answer(scheduler, path, 1000.0, 0.9, 1), "serving_overhead_ms": 0.0}  # none profiled
    assert status == 200 and answer == json.loads(json.dumps(expected))
    status, health = _call(server, "GET", "/healthz")
    assert status == 200 and health["status"] == "ok" and health["steps"][0] == "exit0"
    assert health["input"] == "32x32 grayscale images" and health["max_batch"] == 2 and health["policy"] is not None
    status, spec = _call(server, "GET", "/openapi.json")
    assert status == 200 and {"/predict", "/schedule", "/healthz", "/metrics"} <= set(spec["paths"])
    _call(server, "POST", "/predict?deadline_ms=1000", _png(np.zeros((32, 32), np.uint8)))
    _call(server, "GET", "/nowhere")
    status, text = _call(server, "GET", "/metrics")
    assert status == 200
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values["anytime_requests_total"] >= 1 and values['anytime_bad_requests_total{code="404"}'] >= 1
    assert "anytime_drift_factor" in values and "anytime_queue_depth" in values
    counts = sum(v for k, v in values.items() if k.startswith("anytime_request_seconds_count"))
    assert counts == values["anytime_requests_total"]


def test_serve_refuses_bad_options_in_one_line(exit_run, cli_error, tmp_path):
    cli_error(["serve", str(tmp_path)], "not a run")
    cli_error(["serve", str(exit_run)], "no device profile")


def test_a_batch_that_fails_fails_its_requests_and_the_worker_goes_on():
    clock = FakeClock()
    service, runner = _service(clock, max_batch=1)
    real = runner.predict
    calls = {"n": 0}

    def flaky(x: torch.Tensor, deadline_ms: float, energy_mj: float | None = None) -> AnytimePrediction:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("the model broke")
        return real(x, deadline_ms, energy_mj)

    runner.predict = flaky  # type: ignore[method-assign]
    first = service.submit(Request(torch.zeros(1, 8, 8), 1e6, arrived=0.0))
    second = service.submit(Request(torch.zeros(1, 8, 8), 1e6, arrived=0.0))
    service.start()
    with pytest.raises(RuntimeError, match="the model broke"):
        first.result(timeout=30)
    assert second.result(timeout=30).met
    service.stop()


def test_the_serving_overhead_is_measured_kept_in_the_profile_and_kept_free(server, tmp_path, monkeypatch):
    from anytime.profile import DeviceProfile
    from anytime.serve import ServeOptions, build_app
    from anytime.serve.overhead import measure_serving_overhead

    samples = measure_serving_overhead(server.run, requests=8, warmup=2, gap_ms=0.0)
    assert samples.shape == (8,) and (samples >= 0).all() and np.isfinite(samples).all()
    path = next(server.run.glob("profile-*.json"))
    profile = DeviceProfile.load(path)
    profiled = tmp_path / "profile.json"
    replace(profile, serving=np.array([0.5] * 9 + [3.0])).save(profiled)
    again = DeviceProfile.load(profiled)
    assert again.serving is not None and again.serving.tolist() == [0.5] * 9 + [3.0]
    loads = []
    load = DeviceProfile.load
    monkeypatch.setattr(DeviceProfile, "load", lambda *a, **k: loads.append(a) or load(*a, **k))
    app, service = build_app(ServeOptions(run=str(server.run), profile=str(profiled), quantile=0.9))
    try:
        assert service.runner.margin_ms == pytest.approx(0.5)  # the profile's p90 of the overhead
        assert len(loads) == 1  # the runtime and /schedule price from one reading of the profile
        with listening(app, service) as port:
            status, answer = _call(SimpleNamespace(port=port), "GET", "/schedule?deadline_ms=50")
        assert status == 200 and answer["profile"] == str(profiled) and answer["serving_overhead_ms"] == 0.5
    finally:
        service.stop()
    with pytest.raises(AnytimeError, match="requests >= 1"):
        measure_serving_overhead(server.run, requests=0)
