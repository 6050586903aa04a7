"""Benchmark: `anytime serve` under load, with bad requests mixed in.

The server runs in its own process on 127.0.0.1 (the run's own profile and calibration, its default batching). A
pool of client threads sends requests at Poisson arrival times (open loop: a request's latency is measured from the
time it was due to be sent, so a late client counts against the server, not for it) with one deadline, at a
fraction LOAD of the request rate the profile says the machine can carry (1000 / the profiled median latency of the
option the scheduler picks for that deadline). Every BAD_EVERY-th request is a bad one (garbage bytes, a wrong-size
array, a NaN deadline, no deadline, an oversized body, an unknown route). Reported: throughput, p50/p99 end-to-end
latency as the client sees it (HTTP included), the miss rate as the server counts it (from the request's arrival at
the application to its answer, against the deadline) and as the client sees it, where the difference went (the
client's own lateness in sending, and the time outside the server's count: the client's wall time from send to
answer less the server's ``total_ms``), and whether every good request got an answer and every bad one a 4xx.
Ratio: the client-seen miss target (1% at up to 30% load, 2% above) / the client-seen miss rate (>= 1 passes), and
the run fails whatever the ratio if a good request failed or a bad one was not refused. Profile the run with
``anytime profile RUN --threads 1 --serve`` first, so that the server prices its answers and keeps its HTTP
overhead free at the threads it serves with.
"""

from __future__ import annotations

import http.client
import io
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from common import REPO, parser, report, run

from anytime.errors import AnytimeError
from anytime.scheduler.query import scheduler_for_run

# Hyper-parameters
RUN = REPO / "runs" / "cifar10-resnet32-exits-12ep"  # a profiled (and calibrated) run; --run to change
DEADLINE_MS = 10.0  # every good request's deadline
LOAD = 0.3  # fraction of the profile's capacity at that deadline (the load generator shares the machine's cores)
REQUESTS = 3000  # good and bad together (--quick: 300)
BAD_EVERY = 10  # one request in BAD_EVERY is malformed
CLIENTS = 16  # client threads (keep-alive connections)
SERVER_THREADS = 1  # torch threads of the server: on 2 cores, the other one is left to HTTP and the load generator
YIELD_MS = 0.5  # the server's --yield-ms (its default); 0 to see what the yield points buy
TARGET_CLIENT_MISS = (0.01, 0.02)  # client-seen deadline misses at loads up to 30%, and above
CIFAR_TEST = REPO.parent / "shared" / "data" / "cifar10" / "test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _images(count: int) -> list[bytes]:
    found = sorted(CIFAR_TEST.glob("*/*.jpg"))
    files = found[:: max(1, len(found) // count)][:count]  # spread over the classes' folders
    if files:
        return [f.read_bytes() for f in files]
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buffer, format="PNG")
        out.append(buffer.getvalue())
    return out


def _bad_request(kind: int) -> tuple[str, str, bytes, dict[str, str]]:
    npy = io.BytesIO()
    np.save(npy, np.zeros((7, 7), np.uint8))
    return [
        ("POST", f"/predict?deadline_ms={DEADLINE_MS}", b"\x00garbage\xff" * 20, {}),
        ("POST", f"/predict?deadline_ms={DEADLINE_MS}", npy.getvalue(), {}),
        ("POST", "/predict", b"\x89PNG", {"X-Deadline-Ms": "nan"}),
        ("POST", "/predict", b"\x89PNG", {}),
        ("POST", f"/predict?deadline_ms={DEADLINE_MS}", b"\0" * (2 << 20), {}),
        ("GET", "/admin/../../etc/passwd", b"", {}),
    ][kind % 6]


def _start_server(run_dir: Path, port: int, threads: int | None, yield_ms: float) -> subprocess.Popen[bytes]:
    extra = [*(["--threads", str(threads)] if threads else []), "--yield-ms", str(yield_ms)]
    server = subprocess.Popen([sys.executable, "-m", "anytime", "serve", str(run_dir), "--port", str(port), *extra],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AnytimeError(f"the server did not start: {server.stderr.read().decode().strip()[-300:]}")  # type: ignore[union-attr]
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/healthz")
            if conn.getresponse().status == 200:
                return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise AnytimeError("the server did not answer /healthz within 120 s")


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--run", type=Path, default=RUN, help="a profiled run (default the CIFAR-10 multi-exit ResNet-32)")
    p.add_argument("--deadline-ms", type=float, default=DEADLINE_MS)
    p.add_argument("--load", type=float, default=LOAD, help=f"fraction of the profile's capacity (default {LOAD})")
    p.add_argument(
        "--threads", type=int, default=SERVER_THREADS, help=f"the server's torch threads (default {SERVER_THREADS})"
    )
    p.add_argument("--yield-ms", type=float, default=YIELD_MS, help=f"the server's --yield-ms (default {YIELD_MS})")
    args = p.parse_args()
    scheduler, _ = scheduler_for_run(args.run)
    choice = scheduler.select(args.deadline_ms, 0.99, 1)
    median_ms = scheduler.frontier(0.5, 1)[[o.name for o, _ in scheduler.frontier(0.5, 1)].index(choice.option)][1]
    capacity = 1000.0 / median_ms
    rate = args.load * capacity
    total = 300 if args.quick else REQUESTS
    images = _images(64)
    rng = random.Random(0)
    arrivals = np.cumsum([rng.expovariate(rate) for _ in range(total)])
    print(f"{args.run}: deadline {args.deadline_ms} ms -> {choice.option} (median {median_ms:.2f} ms, capacity "
          f"{capacity:.0f}/s); sending {total} requests at {rate:.0f}/s ({args.load:.0%}), 1 in {BAD_EVERY} bad")  # fmt: skip

    port = _free_port()
    server = _start_server(args.run, port, args.threads, args.yield_ms)
    results: list[dict[str, object]] = [{} for _ in range(total)]
    next_index = iter(range(total))
    lock = threading.Lock()
    start = time.perf_counter() + 0.5

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                conn.close()
                return
            due = start + float(arrivals[i])
            time.sleep(max(0.0, due - time.perf_counter()))
            bad = i % BAD_EVERY == BAD_EVERY - 1
            if bad:
                method, path, body, headers = _bad_request(i // BAD_EVERY)
            else:
                method, path, body, headers = ("POST", f"/predict?deadline_ms={args.deadline_ms}",
                                               images[i % len(images)], {})  # fmt: skip
            sent = time.perf_counter()
            try:
                conn.request(method, path, body=body, headers=headers)
                response = conn.getresponse()
                raw = response.read()
                got = time.perf_counter()
                payload = json.loads(raw or b"{}")
                status = response.status
            except (OSError, http.client.HTTPException, ValueError) as exc:
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                payload, status = {"error": repr(exc)}, 0
                got = time.perf_counter()
            results[i] = {
                "bad": bad,
                "status": status,
                "e2e_ms": 1000 * (time.perf_counter() - due),
                "late_send_ms": 1000 * (sent - due),
                "wire_ms": 1000 * (got - sent),
                **payload,
            }

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    metrics = conn.getresponse().read().decode()
    server.terminate()
    server.wait(timeout=30)

    good = [r for r in results if not r["bad"]]
    bad = [r for r in results if r["bad"]]
    answered = [r for r in good if r["status"] == 200 and r.get("class") is not None]
    failed_good = sum(1 for r in good if r["status"] != 200)  # an expired request (200, no class) is a miss
    refused_bad = sum(1 for r in bad if 400 <= int(r["status"]) < 500)  # type: ignore[call-overload]
    e2e = np.array([r["e2e_ms"] for r in answered], dtype=float)
    server_miss = sum(1 for r in good if not r.get("met")) / len(good)
    client_miss = float((e2e > args.deadline_ms).sum() + len(good) - len(answered)) / len(good)
    queued = np.array([r["queued_ms"] for r in good if r["status"] == 200], dtype=float)
    compute = np.array([r["compute_ms"] for r in answered], dtype=float)
    late_send = np.array([r["late_send_ms"] for r in answered], dtype=float)
    outside = np.array([float(r["wire_ms"]) - float(r["total_ms"]) for r in answered], dtype=float)  # type: ignore[arg-type]
    steps = {}
    for r in answered:
        steps[str(r["step_name"])] = steps.get(str(r["step_name"]), 0) + 1
    figures = {
        "run": str(args.run), "deadline_ms": args.deadline_ms, "option_at_deadline": choice.option,
        "profiled_median_ms": median_ms, "capacity_per_s": capacity, "offered_per_s": rate, "load": args.load,
        "requests": total, "good": len(good), "bad": len(bad), "clients": CLIENTS, "elapsed_s": elapsed,
        "throughput_per_s": len(answered) / elapsed, "e2e_p50_ms": float(np.percentile(e2e, 50)),
        "e2e_p99_ms": float(np.percentile(e2e, 99)), "server_miss_rate": server_miss, "client_miss_rate": client_miss,
        "server_queued_p50_ms": float(np.percentile(queued, 50)), "server_queued_p99_ms": float(np.percentile(queued, 99)),
        "server_compute_p50_ms": float(np.percentile(compute, 50)),
        "server_compute_p99_ms": float(np.percentile(compute, 99)),
        "client_late_send_p50_ms": float(np.percentile(late_send, 50)),
        "client_late_send_p99_ms": float(np.percentile(late_send, 99)),
        "outside_server_p50_ms": float(np.percentile(outside, 50)),
        "outside_server_p99_ms": float(np.percentile(outside, 99)), "yield_ms": args.yield_ms,
        "nothing_fitted": sum(1 for r in answered if r.get("fits") is False), "good_failed": failed_good, "bad_refused": refused_bad, "steps": steps, "cpu_count": os.cpu_count(),
        "server_metrics_requests": next((ln.split()[-1] for ln in metrics.splitlines()
                                         if ln.startswith("anytime_requests_total")), None),
    }  # fmt: skip
    print(f"throughput {figures['throughput_per_s']:.0f}/s; end to end p50 {figures['e2e_p50_ms']:.2f} ms, p99 "
          f"{figures['e2e_p99_ms']:.2f} ms; misses: server {100 * server_miss:.2f}%, client {100 * client_miss:.2f}%; "
          f"good failed {failed_good}/{len(good)}, bad refused {refused_bad}/{len(bad)}; steps {steps}; server queued "
          f"p50/p99 {figures['server_queued_p50_ms']:.2f}/{figures['server_queued_p99_ms']:.2f} ms, compute "
          f"{figures['server_compute_p50_ms']:.2f}/{figures['server_compute_p99_ms']:.2f} ms; outside the server's "
          f"count p50/p99 {figures['outside_server_p50_ms']:.2f}/{figures['outside_server_p99_ms']:.2f} ms (client "
          f"sent late by p50/p99 {figures['client_late_send_p50_ms']:.2f}/{figures['client_late_send_p99_ms']:.2f} "
          f"ms); nothing fitted {figures['nothing_fitted']}")  # fmt: skip
    survived = failed_good == 0 and refused_bad == len(bad)
    target = TARGET_CLIENT_MISS[0] if args.load <= 0.3 else TARGET_CLIENT_MISS[1]
    ratio = target / max(client_miss, 1e-9)
    return report("serve_load", args, figures, ratio, f">= 1 (client-seen miss rate <= {target:.0%}) with every good "
                  "request answered and every bad one refused", ratio >= 1 and survived)  # fmt: skip


if __name__ == "__main__":
    run(main)
