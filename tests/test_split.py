"""Split computing: codecs, the shaped link, the planner on hand-made profiles, and a device and a server talking
over 127.0.0.1 (answers equal to the model run whole, bad requests refused, a dead server answered for).

Timing logic runs on fake clocks; the tests over real sockets check answers and errors, never how long they took.
"""

from __future__ import annotations

import shutil
import socket
import struct
import threading

import numpy as np
import pytest
import torch

from anytime.calibrate import ExitPolicy
from anytime.cli import main
from anytime.errors import AnytimeError
from anytime.outputs import OutputCache
from anytime.profile import BatchLatency, DeviceProfile
from anytime.split import (
    Link,
    LinkError,
    LinkEstimator,
    LinkShaper,
    SplitClient,
    SplitDevice,
    SplitPlanner,
    SplitServer,
    SplitService,
    SplitTables,
    TokenBucket,
)  # fmt: skip
from anytime.split.codec import decode, encode, payload_bytes, roundtrip
from anytime.split.link import Reply, frame, read_frame
from anytime.split.plan import HEADER_BYTES
from anytime.split.session import parse_bandwidth_schedule


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


# ---------------------------------------------------------------- codecs


@pytest.mark.parametrize("shape", [(2, 8, 5, 5), (3, 40)])
def test_codecs_round_trip_within_their_precision_and_cost_what_they_say(shape):
    x = torch.randn(*shape) * 3 + 1
    for codec, tolerance in (("fp32", 0.0), ("fp16", 1e-2), ("int8", None)):
        fields, payload = encode(x, codec)
        assert len(payload) == payload_bytes(shape[1:], codec, shape[0])
        back = decode(fields, payload)
        assert back.shape == x.shape
        if tolerance is None:  # int8: within half a step of its channel
            rows = x.reshape(shape[0], shape[1] if len(shape) > 2 else 1, -1)
            step = (rows.amax(dim=2) - rows.amin(dim=2)) / 255
            error = (back - x).abs().reshape(rows.shape).amax(dim=2)
            assert (error <= step / 2 + 1e-5).all()
        else:
            assert torch.allclose(back, x, atol=tolerance * x.abs().max().item())
    assert (
        payload_bytes((64, 8, 8), "int8") == 64 * 8 * 8 + 8 * 64
    )  # a byte per value, fp32 minimum and step per channel


def test_decode_refuses_what_does_not_match():
    fields, payload = encode(torch.ones(1, 4, 2, 2), "fp16")
    with pytest.raises(AnytimeError, match="needs"):
        decode(fields, payload[:-2])
    with pytest.raises(AnytimeError, match="unknown codec"):
        decode({**fields, "codec": "fp8"}, payload)
    with pytest.raises(AnytimeError, match="shape"):
        decode({**fields, "shape": [1, -4]}, payload)
    constant = roundtrip(torch.full((1, 3, 2, 2), 7.0), "int8")  # a channel with no range decodes exactly
    assert torch.equal(constant, torch.full((1, 3, 2, 2), 7.0))


# ---------------------------------------------------------------- the link


def test_the_token_bucket_paces_bytes_at_its_rate():
    clock = FakeClock()
    bucket = TokenBucket(1000.0, burst=400, clock=clock, sleep=clock.sleep)
    for _ in range(10):
        bucket.consume(400)
    assert clock.now == pytest.approx(3.6)  # 4,000 bytes at 1,000 B/s, the first 400 from the burst


def test_the_shaper_adds_its_delay_and_paces_the_payload():
    clock = FakeClock()
    shaper = LinkShaper(8.0, delay_ms=10.0, clock=clock, sleep=clock.sleep)  # 1 MB/s
    a, b = socket.socketpair()
    try:
        shaper.send(a, bytes(20_000))
        shaper.received(1_000)
        got = 0
        while got < 20_000:
            got += len(b.recv(65536))
    finally:
        a.close()
        b.close()
    # half the delay each way, and all 21,000 bytes at 1 MB/s: an idle link gives no burst for free
    assert clock.now == pytest.approx(0.010 + 21_000 / 1e6)
    with pytest.raises(AnytimeError, match="bandwidth"):
        shaper.set_bandwidth(0.0)


def test_link_refuses_nonsense_and_prices_bytes():
    assert Link(8.0, 2.0).transfer_ms(1000) == pytest.approx(3.0)
    assert Link(8.0, 2.0, 0.5).transfer_ms(1000) == pytest.approx(3.5)
    for bad in ((0, 1), (float("nan"), 1), (1, -1), (1, float("inf")), (1, 1, -0.1), (1, 1, float("nan"))):
        with pytest.raises(AnytimeError):
            Link(*bad)


def test_the_estimator_follows_a_slower_link_faster_than_a_faster_one():
    est = LinkEstimator(Link(100.0, 1.0))
    est.ping(1.0)
    for _ in range(2):
        est.transfer(10_000, 1.0 + 8 * 10_000 / 1000 / 1.0, 0.0)  # 1 Mbit/s transfers
    slowed = est.link.bandwidth_mbps
    assert slowed < 3
    for _ in range(4):
        est.transfer(10_000, 1.0 + 8 * 10_000 / 1000 / 100.0, 0.0)  # back at 100 Mbit/s
    assert slowed < est.link.bandwidth_mbps < 100 / 1.5
    est.transfer(10, 0.5, 0.0)  # faster than the round trip: no information
    assert est.observed == 6


def test_the_estimator_prices_a_stall_as_overhead_not_as_a_slower_link():
    est = LinkEstimator(Link(8.0, 1.0, 0.25), quantile=0.95, window=50, min_observations=10)
    est.ping(1.0)
    for _ in range(9):
        est.transfer(1000, 1.0 + 1.0 + 0.5, 0.0)  # 1 byte = 1 us, and 0.5 ms beyond the bytes
    assert est.overhead_ms == 0.25  # the assumed overhead, until 10 exchanges are in
    for i in range(100):
        est.transfer(1000, 2.5 + (3.0 if i % 10 == 9 else 0.0), 0.0)  # one in ten stalls 3 ms
    link = est.link
    assert link.bandwidth_mbps == pytest.approx(8 / 1.5, rel=0.01)  # the 0.5 ms spread over the bytes: the mean
    assert link.overhead_ms == pytest.approx(3.0, abs=0.01)  # the p95 exchange stalled
    assert link.transfer_ms(1000) == pytest.approx(5.5, abs=0.01)  # what a p95 exchange of these bytes took
    quiet = LinkEstimator(Link(8.0, 1.0), window=50, min_observations=10)
    for _ in range(60):
        quiet.transfer(1000, 2.5, 0.0)
    assert quiet.overhead_ms < 1e-3 and quiet.link.transfer_ms(1000) == pytest.approx(2.5, abs=1e-3)


def test_calibration_tells_the_fixed_cost_of_an_exchange_from_its_cost_per_byte():
    est = LinkEstimator(Link(100.0, 1.0), quantile=0.95, window=100, min_observations=10)
    est.ping(1.0)
    exchanges = []
    for i in range(40):  # 1 byte = 1 us, 0.8 ms fixed per exchange, one in ten stalls 2 ms
        nbytes = 1000 if i % 2 else 4000
        exchanges.append((nbytes, 1.0 + 0.25 + 0.8 + nbytes / 1000 + (2.0 if i % 10 == 9 else 0.0), 0.25))
    est.calibrate(exchanges)
    link = est.link
    assert link.bandwidth_mbps == pytest.approx(8.0, rel=0.01) and est.fixed_ms == pytest.approx(0.8, abs=0.01)
    assert link.overhead_ms == pytest.approx(0.8 + 2.0, abs=0.01)  # the fixed cost and the p95 stall
    for nbytes in (1000, 16_000):  # a p95 exchange of either size, the server's compute aside
        assert link.transfer_ms(nbytes) == pytest.approx(1.0 + nbytes / 1000 + 2.8, abs=0.05)
    spread = LinkEstimator(Link(100.0, 1.0), quantile=0.95, window=100, min_observations=10)
    spread.ping(1.0)
    spread.calibrate([(1000, 2.8, 0.0)] * 20)  # one size: the fixed cost cannot be told apart, and is spread
    assert spread.fixed_ms == 0.0 and spread.link.transfer_ms(1000) == pytest.approx(2.8, abs=0.01)


def test_bandwidth_schedules_parse_and_refuse():
    assert parse_bandwidth_schedule(None, 5.0, 10) == [(5.0, 10)]
    assert parse_bandwidth_schedule("100:4,1", 5.0, 10) == [(100.0, 4), (1.0, 6)]
    for bad in ("x:3", "1,2:3", "0:3", ""):
        with pytest.raises(AnytimeError):
            parse_bandwidth_schedule(bad, 5.0, 10)


# ---------------------------------------------------------------- the planner on hand-made figures


def _profile(stage_ms: list[float], fingerprint: str = "w") -> DeviceProfile:
    n = 100
    stages = tuple(np.full(n, v) for v in stage_ms)
    steps = tuple(np.full(n, float(sum(stage_ms[: k + 1]))) for k in range(len(stage_ms)))
    k = len(stage_ms)
    return DeviceProfile(
        model_fingerprint=fingerprint, model="toy", input_shape=(4,), incremental=True,
        step_names=tuple(f"exit{i}" for i in range(k)), step_flops=tuple(range(1, k + 1)), step_params=(1,) * k,
        model_bytes=4, latency={1: BatchLatency(1, steps, stages)}, device={"type": "cpu", "label": "t"},
        settings={}, created="now",
    )  # fmt: skip


def _tables() -> SplitTables:
    """Three exits, 100 samples: exit 0 is sure and right on the first half, unsure and wrong on the rest; exits 1
    and 2 are sure and right everywhere."""
    n = 100
    labels = np.array([0] * 50 + [1] * 50)
    logits = np.zeros((3, n, 2), dtype=np.float32)
    logits[0, :50] = [6, -6]
    logits[0, 50:] = [0.1, 0]
    for k in (1, 2):
        logits[k, np.arange(n), labels] = 6
        logits[k, np.arange(n), 1 - labels] = -6
    cache = OutputCache(logits=logits, labels=labels, step_names=("a", "b", "c"), step_flops=np.array([1, 2, 3]),
                        cost_flops=np.array([1, 2, 3]), base_flops=3, split="val", model_fingerprint="w")  # fmt: skip
    return SplitTables(cache, {-1: (4,), 0: (100,), 1: (100,)}, {}, ("fp32",))


def _planner(**kwargs) -> SplitPlanner:
    return SplitPlanner(_tables(), _profile([2.0, 2.0, 2.0]), _profile([0.5, 0.5, 0.5]), codecs=("fp32",), **kwargs)


def test_a_fast_link_sends_the_input_to_the_faster_server():
    plan = _planner().plan(Link(1000.0, 1.0), deadline_ms=3.0)
    assert plan.fits and plan.option.partition == -1 and plan.option.accuracy == 1.0
    assert plan.option.device_share == 0.0
    assert plan.option.bytes_per_request == pytest.approx(16 + HEADER_BYTES)
    kinds = {o.partition for o in _planner().options(Link(1000.0, 1.0))}
    assert kinds == {-1, 0, 1, 2}  # server only, both split points and device only are all candidates


def test_a_slow_link_keeps_the_answer_on_the_device_with_a_local_exit():
    plan = _planner().plan(Link(0.01, 1.0), deadline_ms=5.0)
    o = plan.option
    assert plan.fits and o.partition == 2 and o.accuracy == 1.0 and o.device_share == 1.0
    assert 4.0 <= o.latency_ms <= 4.0 + 6.0 / 2047  # p99 is the path to exit 1, read on the grid
    median = _planner().plan(Link(0.01, 1.0), deadline_ms=3.0, quantile=0.5).option
    assert median.thresholds[0] is not None  # DDNN: half the samples leave at the first local exit
    assert median.exit_share[0] == pytest.approx(0.5) and median.device_share == 1.0 and median.accuracy == 1.0
    assert median.bytes_per_request == 0  # sending the unsure half at 10 kbit/s would tie at p50 but cost bytes


def test_a_split_options_latency_mixes_the_local_and_the_remote_paths():
    planner = _planner(partitions=[0])
    link = Link(8.0, 1.0)  # 1 byte = 1 us
    sent = link.transfer_ms(400 + HEADER_BYTES)
    both = [o for o in planner.options(link, 0.99) if o.thresholds[0] is not None and o.exit_share[0] == 0.5
            and o.exit_share[1] == 0.5]  # fmt: skip
    assert both, "a setting where half leave on the device and half at the server's first exit"
    assert both[0].latency_ms == pytest.approx(2.0 + sent + 0.5, abs=0.01)
    assert both[0].bytes_per_request == pytest.approx(0.5 * (400 + HEADER_BYTES))
    median = [o for o in planner.options(link, 0.5) if o.thresholds == both[0].thresholds][0]
    assert median.latency_ms == pytest.approx(2.0, abs=0.01)


def test_an_impossible_deadline_is_answered_with_the_fastest_option_marked():
    plan = _planner().plan(Link(1000.0, 1.0), deadline_ms=0.5)
    assert not plan.fits and "likely miss" in plan.note
    assert plan.option.latency_ms == min(o.latency_ms for o in plan.frontier)
    with pytest.raises(AnytimeError, match="deadline"):
        _planner().plan(Link(1.0, 1.0), deadline_ms=float("nan"))


def test_profiles_of_different_models_are_refused_naming_both():
    with pytest.raises(AnytimeError, match="different models"):
        SplitPlanner(_tables(), _profile([1, 1, 1], "w"), _profile([1, 1, 1], "other"), codecs=("fp32",))
    with pytest.raises(AnytimeError, match="another model"):
        SplitPlanner(_tables(), _profile([1, 1, 1], "x"), _profile([1, 1, 1], "x"), codecs=("fp32",))
    with pytest.raises(AnytimeError, match="steps"):
        SplitPlanner(_tables(), _profile([1, 1]), _profile([1, 1]), codecs=("fp32",))
    with pytest.raises(AnytimeError, match="not with learned gates"):
        _planner(criterion="learned")


class _FakeLinkClient:
    """Answers every request as a server behind a link of ``mbps`` would, in time only (fake clock); every
    ``stall_every``-th exchange stalls ``stall_ms`` more."""

    def __init__(self, clock: FakeClock, mbps: float, *, stall_every: int = 0, stall_ms: float = 0.0) -> None:
        self.clock, self.mbps = clock, mbps
        self.stall_every, self.stall_ms = stall_every, stall_ms
        self.sent: list[dict] = []

    def request(self, header, payload=b""):
        self.sent.append(header)
        nbytes = len(frame(header, payload)) + 60
        wire = 1.0 + 8 * nbytes / (1000 * self.mbps)
        if self.stall_every and len(self.sent) % self.stall_every == 0:
            wire += self.stall_ms
        self.clock.now += wire / 1000
        return Reply(
            {"ok": True, "prediction": [0], "exit": [2], "compute_ms": 0.0, "type": "pong"}, wire, nbytes - 60, 60
        )


class _Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.segments = [torch.nn.Identity(), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)]
        self.heads = [torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)]


def test_a_link_that_slows_down_moves_the_answer_toward_the_device():
    clock = FakeClock()
    client = _FakeLinkClient(clock, 1000.0)
    device = SplitDevice(_Toy(), _planner(), client, deadline_ms=5.0, link=Link(1000.0, 1.0), clock=clock)
    device.ping()
    assert device.plan.option.partition == -1
    device.answer(torch.zeros(1, 4))
    client.mbps = 0.01  # the link collapses
    for _ in range(3):
        device.answer(torch.zeros(1, 4))
    assert device.plan.option.device_share == 1.0 and device.replans
    assert device.estimator.link.bandwidth_mbps < 0.1


def test_the_device_measures_the_links_stalls_before_it_plans():
    clock = FakeClock()
    client = _FakeLinkClient(clock, 1000.0, stall_every=10, stall_ms=3.0)
    device = SplitDevice(_Toy(), _planner(), client, deadline_ms=4.5, link=Link(1000.0, 1.0), clock=clock)
    device.ping()
    assert device.plan.option.partition == -1  # priced without stalls, sending the input fits (about 2.5 ms)
    link = device.measure_link(torch.zeros(1, 4), 50)
    assert len(client.sent) == 3 + 50 and all(h["partition"] == -1 for h in client.sent[3:])
    assert link.overhead_ms == pytest.approx(3.0, abs=0.05)  # one exchange in ten stalls: at p99, every plan pays
    assert device.plan.link == link and device.plan.option.partition == 2  # the device's own path (4 ms) now fits
    assert device.plan.fits and device.plan.to_dict()["link_overhead_ms"] == link.overhead_ms


# ---------------------------------------------------------------- two real endpoints over 127.0.0.1


@pytest.fixture(scope="module")
def split_setup(exit_run, tmp_path_factory):
    from anytime.tasks.collect import collect_run
    from anytime.tasks.profiling import ProfileSettings, profile_run

    folder = tmp_path_factory.mktemp("split")
    run = shutil.copytree(exit_run, folder / "run")  # the session's run stays as trained, for the other modules
    collect_run(run, "val")
    profile_run(run, ProfileSettings(batch_sizes=(1,), repeats=20, warmup=2, memory=False), out=folder / "dev.json")
    shutil.copy(folder / "dev.json", folder / "srv.json")  # one machine plays both; 20 repeats resolve a p90
    return run, folder / "dev.json", folder / "srv.json"


@pytest.fixture
def server(split_setup):
    from anytime.train.runs import load_run

    run = load_run(split_setup[0])
    service = SplitService(run.model, (1, 32, 32), fingerprint=run.fingerprint)
    srv = SplitServer(service, "127.0.0.1", 0, max_payload=1 << 20)
    srv.start()
    yield srv
    srv.shutdown()


def _device(
    split_setup, port: int, *, partitions, codecs=("fp32",), timeout_s: float = 5.0
) -> tuple[SplitDevice, object]:
    from anytime.split.runs import split_tables
    from anytime.train.runs import load_run

    run_dir, dev, srv = split_setup
    tables = split_tables(run_dir, codecs)
    planner = SplitPlanner(
        tables, DeviceProfile.load(dev), DeviceProfile.load(srv), codecs=codecs, partitions=partitions
    )
    run = load_run(run_dir)
    client = SplitClient("127.0.0.1", port, timeout_s=timeout_s)
    return SplitDevice(run.model, planner, client, deadline_ms=1000.0, quantile=0.9, link=Link(1000.0, 0.0),
                       adapt=False), run  # fmt: skip


def _images(count: int) -> torch.Tensor:
    return torch.randn(count, 1, 32, 32, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("partition", [-1, 0, 1])
def test_device_and_server_answer_as_the_whole_model_does(split_setup, server, partition):
    device, run = _device(split_setup, server.address[1], partitions=[partition])
    policy = device.policy
    images = _images(12)
    whole = policy.run(run.model, images)
    answers = [device.answer(images[i : i + 1]) for i in range(len(images))]
    assert [a.prediction for a in answers] == whole.predictions.tolist()
    assert [a.exit for a in answers] == whole.exits.tolist()
    for a in answers:
        assert a.where == ("server" if a.exit > partition else "device")
        assert (a.sent_bytes > 0) == (a.where == "server")
        assert a.total_ms >= a.server_ms >= 0


def test_lossy_codecs_are_measured_and_close_to_fp32(split_setup):
    from anytime.split.runs import split_tables
    from anytime.split.tables import load_tables, tables_path

    tables = split_tables(split_setup[0], ("fp32", "fp16", "int8"))
    assert tables_path(split_setup[0]).is_file()
    again = load_tables(split_setup[0], tables.model_fingerprint)
    assert again is not None and set(again.compressed) == set(tables.compressed)
    base = tables.cache.step_accuracy()
    for k in (-1, 0, 1):
        assert np.allclose(tables.cache_for(k, "fp16").step_accuracy(), base, atol=0.01)
        assert np.abs(tables.cache_for(k, "int8").step_accuracy() - base).max() <= 0.05
        assert np.array_equal(tables.cache_for(k, "int8").logits[: k + 1], tables.cache.logits[: k + 1])


def test_the_server_refuses_bad_requests_in_one_sentence_and_keeps_serving(split_setup, server):
    client = SplitClient(*server.address)
    fields, payload = encode(torch.zeros(1, 1, 32, 32), "fp32")
    good = {"type": "infer", "partition": -1, **fields, "criterion": "entropy", "thresholds": [None, None]}
    bad = [
        ({**good, "shape": [1, 3, 32, 32]}, payload, "shape"),
        ({**good, "partition": 7}, payload, "partition"),
        ({**good, "thresholds": [None]}, payload, "thresholds"),
        ({**good, "codec": "fp8"}, payload, "codec"),
        (good, payload[:-4], "bytes"),
        ({"type": "rm -rf"}, b"", "unknown request type"),
    ]
    for header, body, word in bad:
        with pytest.raises(LinkError, match=word):
            client.request(header, body)
    nan = encode(torch.full((1, 1, 32, 32), float("nan")), "fp32")[1]
    with pytest.raises(LinkError, match="NaN"):
        client.request(good, nan)
    with socket.create_connection(server.address) as raw:  # garbage framing: that connection is closed
        raw.sendall(b"\x00\x00\x00\x05\x00\x00\x00\x00hello")
        header, _ = read_frame(raw, 1 << 16)
        assert header["ok"] is False and "JSON" in header["error"]
    deep = b"[" * 30_000
    with socket.create_connection(server.address) as raw:  # a header nested past any parser's stack: refused, answered
        raw.sendall(struct.pack(">II", len(deep), 0) + deep)
        header, _ = read_frame(raw, 1 << 16)
        assert header["ok"] is False and "nests 30000 levels" in header["error"]
    assert client.request(good, payload).header["ok"] is True


def test_an_unreachable_server_is_answered_for_on_the_device(split_setup):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens here once closed
    device, run = _device(split_setup, port, partitions=[-1], timeout_s=0.5)
    image = _images(1)
    answer = device.answer(image)
    assert answer.where == "fallback" and "unreachable" in answer.note
    assert answer.exit >= 0
    expected = run.model.forward_until(image, answer.exit).argmax(dim=1).item()
    assert answer.prediction == expected


def test_a_server_that_dies_mid_request_is_answered_for(split_setup):
    listener = socket.create_server(("127.0.0.1", 0))

    def accept_and_hang_up() -> None:
        conn, _ = listener.accept()
        conn.recv(16)
        conn.close()

    thread = threading.Thread(target=accept_and_hang_up, daemon=True)
    thread.start()
    device, _ = _device(split_setup, listener.getsockname()[1], partitions=[-1], timeout_s=2.0)
    answer = device.answer(_images(1))
    thread.join(timeout=5)
    listener.close()
    assert answer.where == "fallback" and "failed" in answer.note


def test_split_command_answers_json_and_refuses_a_foreign_profile(split_setup, tmp_path, capsys, cli_error):
    import json

    run_dir, dev, srv = split_setup
    assert main(["split", str(run_dir), "--device-profile", str(dev), "--server-profile", str(srv),
                 "--bandwidth-mbps", "10", "--rtt-ms", "2", "--deadline-ms", "10000", "--quantile", "0.9", "--json"]) == 0  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] and {"partition", "codec", "thresholds", "device_share", "bytes_per_request"} <= set(doc)
    partitions = {o["partition"] for o in doc["frontier"]}
    assert partitions <= {-1, 0, 1, 2}
    fastest = []
    for overhead in ("0", "5"):
        assert main(["split", str(run_dir), "--device-profile", str(dev), "--server-profile", str(srv),
                     "--bandwidth-mbps", "10", "--rtt-ms", "2", "--overhead-ms", overhead, "--deadline-ms", "10000",
                     "--quantile", "0.9", "--partitions", "server", "--json"]) == 0  # fmt: skip
        sent = json.loads(capsys.readouterr().out)
        assert sent["link_overhead_ms"] == float(overhead)
        fastest.append(sent["frontier"][0]["latency_ms"])
    assert fastest[1] == pytest.approx(fastest[0] + 5.0, abs=0.05)  # every exchange pays the overhead
    foreign = json.loads(dev.read_text())
    foreign["model_fingerprint"] = "0" * 16
    (tmp_path / "foreign.json").write_text(json.dumps(foreign))
    cli_error(["split", str(run_dir), "--device-profile", str(tmp_path / "foreign.json"), "--server-profile", str(srv),
               "--bandwidth-mbps", "10", "--deadline-ms", "50", "--quantile", "0.9"], "another model")  # fmt: skip
    cli_error(["split", str(run_dir), "--device-profile", str(dev), "--server-profile", str(srv),
               "--bandwidth-mbps", "0", "--deadline-ms", "50"], "bandwidth")  # fmt: skip
    cli_error(["split", str(run_dir), "--device-profile", str(dev), "--server-profile", str(srv),
               "--bandwidth-mbps", "1", "--overhead-ms", "-1", "--deadline-ms", "50"], "overhead")  # fmt: skip
    cli_error(["split-run", str(run_dir), "--server", "127.0.0.1:1", "--device-profile", str(dev), "--server-profile",
               str(srv), "--bandwidth-mbps", "10", "--deadline-ms", "50", "--emulate-slowdown", "3"],
              "emulate-slowdown")  # fmt: skip
    cli_error(["serve", str(run_dir), "--role", "server", "--workers", "2"], "--workers", "--role server")
    cli_error(["split", str(run_dir), "--device-profile", str(dev), "--server-profile", str(srv), "--bandwidth-mbps",
               "10", "--deadline-ms", "50", "--quantile", "0.9", "--partitions", "edge"], "--partitions", "edge")  # fmt: skip


def test_split_run_over_a_real_server(split_setup, server, tmp_path, capsys):
    import json

    run_dir, dev, srv = split_setup
    out = tmp_path / "session.json"
    assert main(["split-run", str(run_dir), "--server", "{}:{}".format(*server.address), "--device-profile", str(dev),
                 "--server-profile", str(srv), "--bandwidth-mbps", "50", "--deadline-ms", "200", "--requests", "12",
                 "--shape-bandwidth", "50:6,20", "--quantile", "0.9", "--out", str(out), "--json"]) == 0  # fmt: skip
    summary = json.loads(capsys.readouterr().out)
    assert summary["requests"] == 12 and summary["fallback_share"] == 0
    assert [p["bandwidth_mbps"] for p in summary["phases"]] == [50.0, 20.0]
    first = summary["replans"][0]  # planned after 100 exchanges that measured the link
    assert first["link_overhead_ms"] >= 0 and first["bandwidth_mbps"] > 0
    saved = json.loads(out.read_text())
    assert len(saved["answers"]) == 12 and all("label" in a for a in saved["answers"])
    mine = tmp_path / "mine.txt"
    mine.write_text("my notes")
    assert main(["split-run", str(run_dir), "--server", "{}:{}".format(*server.address), "--device-profile", str(dev),
                 "--server-profile", str(srv), "--bandwidth-mbps", "50", "--deadline-ms", "200", "--requests", "2",
                 "--out", str(mine)]) == 2  # fmt: skip
    assert mine.read_text() == "my notes" and "never overwrites" in capsys.readouterr().err


def test_an_emulated_slower_board_waits_in_proportion():
    from anytime.profile.slowed import slowed_model

    clock = FakeClock()

    class Ticking(torch.nn.Module):
        def forward(self, h):
            clock.now += 0.001
            return h

    toy = _Toy()
    toy.segments = [Ticking(), Ticking(), Ticking()]
    toy.heads = [Ticking(), Ticking()]
    slow = slowed_model(toy, 3.0, clock=clock, sleep=clock.sleep)
    list(slow.steps(torch.zeros(1, 4)))
    assert clock.now == pytest.approx(3 * 0.005)  # five parts of 1 ms each, three times slower
    with pytest.raises(AnytimeError, match="emulate-slowdown"):
        slowed_model(toy, 0.5)
    assert slowed_model(toy, 1.0) is toy
    assert ExitPolicy("entropy", (None, None)).num_steps == slow.num_steps


def test_an_ensemble_splits_between_its_members():
    """Partition k of an ensemble: the device runs members 0..k and sends the input with their answers."""
    from test_ensembles import _ensemble

    model, _ = _ensemble()
    service = SplitService(model, (3, 2, 2))
    srv = SplitServer(service, "127.0.0.1", 0)
    srv.start()
    try:
        x = torch.randn(6, 3, 2, 2, generator=torch.Generator().manual_seed(1))
        policy = ExitPolicy("entropy", (None, None))
        whole = policy.run(model, x).predictions.tolist()
        for k in (-1, 0, 1):
            client = SplitClient(*srv.address)
            h = x
            segments = model.segments
            for j in range(k + 1):
                h = segments[j](h)
            fields, payload = encode(h, "fp32")
            header = {"type": "infer", "partition": k, **fields, "criterion": "entropy", "thresholds": [None, None]}
            assert client.request(header, payload).header["prediction"] == whole
            client.close()
    finally:
        srv.shutdown()


def test_a_profile_can_idle_between_repetitions():
    from anytime.profile import Instruments, StepTiming, profile_model

    clock = FakeClock()
    profile = profile_model(
        torch.nn.Linear(4, 2),
        (4,),
        StepTiming(batch_sizes=(1,), repeats=5, warmup=1, gap_s=0.02),
        instruments=Instruments(sleep=clock.sleep),
    )
    assert clock.slept == [0.02] * 5 and profile.settings["gap_ms"] == 20
    with pytest.raises(AnytimeError, match="gap"):
        profile_model(torch.nn.Linear(4, 2), (4,), StepTiming(batch_sizes=(1,), repeats=1, gap_s=-1.0))


def test_the_planner_prices_the_server_from_its_suffixes_where_it_has_them():
    from dataclasses import replace

    server = _profile([0.5, 0.5, 0.5])
    cold = tuple(tuple(np.full(100, 3.0) for _ in range(2 - k)) for k in range(2))  # after partition 0: 2 stages
    with_suffixes = replace(server, latency={1: replace(server.at(1), suffixes=cold)})
    link = Link(8.0, 1.0)
    sent = link.transfer_ms(400 + HEADER_BYTES)

    def to_the_last_exit(srv: DeviceProfile) -> float:
        planner = SplitPlanner(_tables(), _profile([2.0, 2.0, 2.0]), srv, codecs=("fp32",), partitions=[0])
        return [o for o in planner.options(link, 0.99) if o.thresholds == (None, None)][0].latency_ms

    assert to_the_last_exit(server) == pytest.approx(2.0 + sent + 1.0, abs=0.01)  # read off the full pass
    assert to_the_last_exit(with_suffixes) == pytest.approx(2.0 + sent + 6.0, abs=0.01)


def test_a_profile_times_what_the_server_runs_after_each_partition(exit_run):
    from anytime.profile import Instruments, StepTiming, profile_model
    from anytime.train.runs import load_run

    clock = FakeClock()
    model = load_run(exit_run).model
    k = model.num_steps
    profile = profile_model(
        model,
        (1, 32, 32),
        StepTiming(batch_sizes=(1,), repeats=4, warmup=1, gap_s=0.01, suffixes=True),
        instruments=Instruments(sleep=clock.sleep, clock=clock),
    )
    suffixes = profile.at(1).suffixes
    assert [len(part) for part in suffixes] == list(range(k - 1, 0, -1))
    assert all(s.size == 4 and not s.any() for part in suffixes for s in part)  # the idle gap is never timed
    assert len(clock.slept) == 4 * k  # before each repetition, and before each partition's suffix
    again = DeviceProfile.from_dict(profile.to_dict())
    assert np.array_equal(again.at(1).suffix_paths(0), profile.at(1).suffix_paths(0))
    assert again.at(1).suffix_paths(0).shape == (k - 1, 4) and again.settings["suffixes"] is True
    with pytest.raises(AnytimeError, match="suffixes"):
        profile_model(torch.nn.Linear(4, 2), (4,), StepTiming(batch_sizes=(1,), repeats=1, suffixes=True))
    broken = profile.to_dict()
    broken["batches"][0]["suffixes"] = broken["batches"][0]["suffixes"][:1]
    with pytest.raises(AnytimeError, match="malformed"):
        DeviceProfile.from_dict(broken)


def test_profile_refuses_a_negative_gap_and_suffixes_of_a_run_without_exits(exit_run, tmp_path, cli_error):
    from anytime.train import TrainConfig, Trainer

    cli_error(["profile", str(exit_run), "--gap-ms", "-3", "--repeats", "1", "--no-memory"], "--gap-ms", "-3")
    plain = tmp_path / "plain"
    Trainer(TrainConfig(model="lenet", data="digits", epochs=1, limit_train=64, device="cpu"), plain).fit()
    cli_error(["profile", str(plain), "--suffixes", "--repeats", "1", "--no-memory", "--out", str(tmp_path / "p.json")],
              "--suffixes", "exits")  # fmt: skip
    assert not (tmp_path / "p.json").exists()
