"""The server's own part of an answer: what a client on this machine waits beyond the time the server counts.

The server counts a request's time from the moment the application first sees it (its headers parsed) to its
answer. Before that the HTTP server reads and parses the request; after it the answer is serialised and sent. None
of that is in the runtime's price. :func:`measure_serving_overhead` serves the run on 127.0.0.1, sends it requests
one at a time with Poisson arrivals from one keep-alive client, and keeps, per request, the client's wall time less
the server's own ``total_ms``: ``anytime profile RUN --serve`` stores those samples in the profile, and ``anytime
serve`` keeps their quantile free at the end of every deadline (the runner's ``margin_ms``).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path

import numpy as np

from anytime.errors import AnytimeError

DEFAULT_REQUESTS = 300
DEFAULT_GAP_MS = 5.0
_GENEROUS_MS = 60_000.0  # the requests' deadline: the answer's path, not the deadline, is what is timed


def measure_serving_overhead(
    run_dir: str | Path, *, profile: str | Path | None = None, requests: int = DEFAULT_REQUESTS,
    gap_ms: float = DEFAULT_GAP_MS, warmup: int = 20, threads: int | str | None = None, seed: int = 0,
) -> np.ndarray:  # fmt: skip
    """Per request (ms): the client's wall time from sending to the whole answer read, less the server's
    ``total_ms``, for ``requests`` requests after ``warmup``, each after an exponential idle gap of mean ``gap_ms``."""
    try:
        import uvicorn
    except ImportError:
        raise AnytimeError(
            "measuring the server's overhead needs FastAPI and uvicorn: pip install 'anytime[serve]'"
        ) from None
    from anytime.data.inputs import InputSpec, TextSpec
    from anytime.serve.http import ServeOptions, build_app
    from anytime.train.records import read_record
    from anytime.train.splits import run_tokenizer

    if requests < 1 or warmup < 0 or not 0 <= gap_ms < 60_000:
        raise AnytimeError(
            f"need requests >= 1, warmup >= 0 and a gap of 0 to 60000 ms (got {requests}, {warmup}, {gap_ms})"
        )
    dataset = read_record(run_dir).get("dataset", {})
    text = dataset.get("modality") == "text"
    spec = (
        TextSpec.from_tokenizer(run_tokenizer(run_dir), dataset, run_dir) if text else InputSpec.from_dataset(dataset)
    )
    app, service = build_app(ServeOptions(run=str(run_dir), profile=None if profile is None else str(profile),
                                          max_batch=1, threads=threads, device="cpu"))  # fmt: skip
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name="anytime-overhead", daemon=True)
    thread.start()
    try:
        port = _wait_for(server, thread)
        body, kind = spec.example(), "text/plain" if text else "application/octet-stream"
        rng = np.random.default_rng(seed)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        samples = []
        for i in range(warmup + requests):
            if gap_ms:
                time.sleep(float(rng.exponential(gap_ms / 1000.0)))
            start = time.perf_counter()
            conn.request("POST", "/predict", body, headers={"Content-Type": kind, "X-Deadline-Ms": str(_GENEROUS_MS)})
            response = conn.getresponse()
            answer = json.loads(response.read())
            waited = 1000.0 * (time.perf_counter() - start)
            if response.status != 200:
                raise AnytimeError(f"the server refused the overhead probe: {answer.get('error', response.status)}")
            if i >= warmup:
                samples.append(max(waited - float(answer["total_ms"]), 0.0))
        conn.close()
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        service.stop()
    return np.asarray(samples)


def _wait_for(server: object, thread: threading.Thread) -> int:
    deadline = time.monotonic() + 60
    while not getattr(server, "started", False):
        if not thread.is_alive() or time.monotonic() > deadline:
            raise AnytimeError("the server for the overhead probe did not start on 127.0.0.1")
        time.sleep(0.02)
    return int(server.servers[0].sockets[0].getsockname()[1])  # type: ignore[attr-defined]
