"""Benchmark: `anytime serve` soaked for minutes in valid traffic, hostile requests and stalled connections.

The server runs in its own process on 127.0.0.1 with a profiled, calibrated run (``--run``; the one serve_load
uses by default). For DURATION_S seconds: GOOD_CLIENTS threads send valid images at LOAD of the capacity the
profile gives at the deadline; one thread cycles through hostile requests (a PNG whose header declares 30000x30000
pixels, an .npy header declaring 1e18 elements, JSON nested 100,000 deep, a form of 15,000 parts, a body over the
size limit, garbage, an unknown route, an image sent in JSON); one thread keeps STALLED connections open that send
half a request and then nothing; a prober times GET /healthz every PROBE_S seconds. Reported: answered/s, the good
requests' p99 end to end, the server's miss rate, the count of 5xx answers and of good requests that got no answer
(target 0), the server's resident memory growth from the end of the warm-up to the end (target < 5%), and
/healthz p99 under attack (target < 50 ms). Ratio: 50 ms / the /healthz p99 (>= 1 passes, with the other two).
"""

from __future__ import annotations

import http.client
import json
import socket
import struct
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import serve_load
from common import parser, report, run

from anytime.scheduler.query import scheduler_for_run

# Hyper-parameters
DURATION_S = 180.0  # the soak (--quick: 20 s)
WARMUP_S = 15.0  # memory is measured from here on (--quick: 5 s)
LOAD = 0.2  # valid traffic, as a fraction of the profile's capacity at the deadline
DEADLINE_MS = 10.0
GOOD_CLIENTS = 4
STALLED = 32  # connections held open with half a request
PROBE_S = 0.05  # /healthz every 50 ms
TARGETS = {"healthz_p99_ms": 50.0, "rss_growth": 0.05, "server_errors": 0}


def _png_bomb() -> bytes:
    """A PNG whose header declares 30000 x 30000 RGB pixels (and holds almost no data)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


def _hostile() -> list[tuple[str, str, bytes, dict[str, str]]]:
    npy_header = b"{'descr': '|u1', 'fortran_order': False, 'shape': (1000000000000000000,), }"
    npy = b"\x93NUMPY\x01\x00" + struct.pack("<H", 118) + npy_header.ljust(117) + b"\n"
    boundary = "b0undary"
    form = "".join(f'--{boundary}\r\nContent-Disposition: form-data; name="f{i}"\r\n\r\nx\r\n' for i in range(15000))
    q = f"/predict?deadline_ms={DEADLINE_MS}"
    return [
        ("POST", q, _png_bomb(), {"Content-Type": "image/png"}),
        ("POST", q, npy, {"Content-Type": "application/octet-stream"}),
        ("POST", "/predict", b"[" * 100_000 + b"]" * 100_000, {"Content-Type": "application/json"}),
        (
            "POST",
            "/predict",
            (form + f"--{boundary}--\r\n").encode(),
            {"Content-Type": f"multipart/form-data; boundary={boundary}"},
        ),  # fmt: skip
        ("POST", q, b"\0" * (4 << 20), {}),
        ("POST", q, b"\x00garbage\xff" * 50, {}),
        ("GET", "/admin/../../etc/passwd", b"", {}),
        (
            "POST",
            "/predict",
            json.dumps({"image": "aGVsbG8=", "deadline_ms": 10}).encode(),
            {"Content-Type": "application/json"},
        ),  # fmt: skip
    ]


def _valid_images(run_dir: Path, count: int) -> list[bytes]:
    """PNGs of the run's input shape (random pixels): what it takes, whatever data it was trained on."""
    import io

    from PIL import Image

    from anytime.data.inputs import InputSpec
    from anytime.train.records import read_record

    spec = InputSpec.from_dataset(read_record(run_dir)["dataset"])
    rng = np.random.default_rng(0)
    shape = (spec.height, spec.width) if spec.channels == 1 else (spec.height, spec.width, spec.channels)
    images = []
    for _ in range(count):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(buffer, format="PNG")
        images.append(buffer.getvalue())
    return images


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--run", type=Path, default=serve_load.RUN, help="a profiled, calibrated run")
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads (default 1)")
    args = p.parse_args()
    duration, warmup = (20.0, 5.0) if args.quick else (DURATION_S, WARMUP_S)
    scheduler, _ = scheduler_for_run(args.run)
    choice = scheduler.select(DEADLINE_MS, 0.99, 1)
    median_ms = dict((o.name, ms) for o, ms in scheduler.frontier(0.5, 1))[choice.option]
    rate = LOAD * 1000.0 / median_ms
    port = serve_load._free_port()
    server = serve_load._start_server(args.run, port, args.threads)
    images = _valid_images(args.run, 64)
    hostile = _hostile()
    stop = time.perf_counter() + duration
    lock = threading.Lock()
    good: list[tuple[int, float, bool]] = []  # status, e2e ms, met
    bad: list[int] = []
    probes: list[float] = []
    probe_failures = [0]
    rss: dict[str, int] = {}

    def good_client(seed: int) -> None:
        rng = np.random.default_rng(seed)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        due = time.perf_counter()
        while due < stop:
            due += float(rng.exponential(GOOD_CLIENTS / rate))
            time.sleep(max(0.0, due - time.perf_counter()))
            try:
                conn.request("POST", f"/predict?deadline_ms={DEADLINE_MS}", body=images[int(rng.integers(64))])
                response = conn.getresponse()
                answer = json.loads(response.read() or b"{}")
                item = (response.status, 1000 * (time.perf_counter() - due), bool(answer.get("met")))
            except (OSError, http.client.HTTPException, ValueError):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                item = (0, 1000 * (time.perf_counter() - due), False)
            with lock:
                good.append(item)

    def hostile_client() -> None:
        i = 0
        while time.perf_counter() < stop:
            method, path, body, headers = hostile[i % len(hostile)]
            i += 1
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
            try:
                conn.request(method, path, body=body, headers=headers)
                status = conn.getresponse().status
            except (OSError, http.client.HTTPException):
                status = 0  # the connection closed on a refused body: not an answer, not a 5xx
            finally:
                conn.close()
            with lock:
                bad.append(status)
            time.sleep(0.05)

    def stalled_client() -> None:
        held: list[socket.socket] = []
        while time.perf_counter() < stop:
            while len(held) < STALLED:
                try:
                    s = socket.create_connection(("127.0.0.1", port), timeout=5)
                    s.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\nhalf")
                    held.append(s)
                except OSError:
                    break
            time.sleep(1.0)
            alive = []
            for s in held:  # the server closes what it timed out; open new ones in their place
                s.setblocking(False)
                try:
                    if s.recv(1) == b"":
                        s.close()
                        continue
                except BlockingIOError:
                    pass
                except OSError:
                    s.close()
                    continue
                alive.append(s)
            held = alive
        for s in held:
            s.close()

    def prober() -> None:
        while time.perf_counter() < stop:
            start = time.perf_counter()
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/healthz")
                conn.getresponse().read()
                conn.close()
                probes.append(1000 * (time.perf_counter() - start))
            except (OSError, http.client.HTTPException):
                probe_failures[0] += 1
            if "start" not in rss and time.perf_counter() > stop - duration + warmup:
                rss["start"] = _rss_kb(server.pid)
            time.sleep(PROBE_S)
        rss["end"] = _rss_kb(server.pid)

    threads = [threading.Thread(target=good_client, args=(i,)) for i in range(GOOD_CLIENTS)]
    threads += [threading.Thread(target=hostile_client), threading.Thread(target=stalled_client),
                threading.Thread(target=prober)]  # fmt: skip
    print(f"{args.run}: {duration:.0f} s of {rate:.0f} valid requests/s ({choice.option} at {DEADLINE_MS} ms), "
          f"hostile requests and {STALLED} stalled connections")  # fmt: skip
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    server.terminate()
    server.wait(timeout=30)

    statuses = [s for s, _, _ in good]
    answered = [e for s, e, _ in good if s == 200]
    server_errors = sum(1 for s in statuses + bad if s >= 500)
    unanswered = sum(1 for s in statuses if s != 200)
    growth = (rss["end"] - rss["start"]) / rss["start"] if rss.get("start") else float("nan")
    healthz_p99 = float(np.percentile(probes, 99)) if probes else float("inf")
    figures = {
        "run": str(args.run), "duration_s": elapsed, "offered_per_s": rate, "answered_per_s": len(answered) / elapsed,
        "good_requests": len(good), "good_unanswered": unanswered,
        "good_e2e_p99_ms": float(np.percentile(answered, 99)) if answered else None,
        "server_miss_rate": sum(1 for s, _, met in good if s == 200 and not met) / max(1, len(answered)),
        "hostile_requests": len(bad), "hostile_statuses": {str(s): bad.count(s) for s in sorted(set(bad))},
        "server_errors_5xx": server_errors, "rss_start_kb": rss.get("start"), "rss_end_kb": rss.get("end"),
        "rss_growth": growth, "healthz_probes": len(probes), "healthz_failures": probe_failures[0],
        "healthz_p50_ms": float(np.percentile(probes, 50)) if probes else None, "healthz_p99_ms": healthz_p99,
        "stalled_connections": STALLED, "targets": TARGETS,
    }  # fmt: skip
    print(f"answered {figures['answered_per_s']:.1f}/s (p99 {figures['good_e2e_p99_ms']} ms), unanswered "
          f"{unanswered}/{len(good)}; hostile {figures['hostile_statuses']}; 5xx {server_errors}; RSS "
          f"{rss.get('start')} -> {rss.get('end')} kB ({100 * growth:+.1f}%); /healthz p50 "
          f"{figures['healthz_p50_ms']:.1f} ms, p99 {healthz_p99:.1f} ms, {probe_failures[0]} failed")  # fmt: skip
    passed = (server_errors == 0 and unanswered == 0 and probe_failures[0] == 0 and growth < TARGETS["rss_growth"]
              and healthz_p99 < TARGETS["healthz_p99_ms"])  # fmt: skip
    ratio = TARGETS["healthz_p99_ms"] / healthz_p99
    return report("serve_soak", args, figures, ratio, ">= 1 (/healthz p99 < 50 ms under attack), with 0 5xx, every "
                  "valid request answered and RSS growth < 5%", passed)  # fmt: skip


if __name__ == "__main__":
    run(main)
