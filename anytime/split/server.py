"""The server's half of split computing (``anytime serve RUN --role server``): it receives an activation (its
partition point, codec and shape), runs the segments after it and answers with the exit reached and the class.

Every request is checked before any compute (the partition exists, the shape is the one the model has there, the
payload matches the codec); a bad one gets ``{"ok": false, "error": ...}`` and the connection stays open. A
malformed frame (no JSON, over the size limit) closes that connection only; the server keeps serving others.
"""

from __future__ import annotations

import socketserver
import threading
import time
from collections.abc import Callable
from typing import Any

from anytime.calibrate import ExitPolicy
from anytime.errors import AnytimeError
from anytime.split.codec import decode
from anytime.split.link import frame, read_frame
from anytime.utils.collector import collect_due


class SplitService:
    """The model side, without sockets: :meth:`handle` turns one request (header, payload) into a reply header."""

    def __init__(self, model: Any, input_shape: tuple[int, ...], *, fingerprint: str | None = None,
                 clock: Callable[[], float] = time.perf_counter, max_batch: int = 64) -> None:  # fmt: skip
        import torch

        segments = getattr(model, "segments", None)
        heads = getattr(model, "heads", None)
        if not isinstance(segments, (tuple, list)) or heads is None or len(segments) < 2:
            raise AnytimeError("split computing needs a run with exits or an ensemble (a model with segments)")
        model.eval()
        self.model = model
        self.segments = tuple(segments)  # fetched once: an ensemble's segments share one pass's state
        self.heads = list(heads)
        self.fingerprint = fingerprint
        self.max_batch = max_batch
        self._clock = clock
        self._lock = threading.Lock()
        self.shapes: dict[int, tuple[int, ...]] = {-1: tuple(input_shape)}
        with torch.inference_mode():
            h = torch.zeros(1, *input_shape)
            for k, segment in enumerate(self.segments[:-1]):
                h = segment(h)
                self.shapes[k] = tuple(int(s) for s in h.shape[1:])

    @property
    def num_steps(self) -> int:
        """K."""
        return len(self.segments)

    def handle(self, header: dict[str, Any], payload: bytes) -> dict[str, Any]:
        """One request's reply; bad requests get one sentence, never a traceback."""
        kind = header.get("type")
        if kind == "ping":
            return {"ok": True, "type": "pong", "fingerprint": self.fingerprint, "steps": self.num_steps}
        if kind == "probe":
            return {"ok": True, "type": "probe", "bytes": len(payload)}
        if kind != "infer":
            return {"ok": False, "error": f"unknown request type {kind!r}; send ping, probe or infer"}
        try:
            return self._infer(header, payload)
        except AnytimeError as exc:
            return {"ok": False, "id": header.get("id"), "error": str(exc)}

    def _infer(self, header: dict[str, Any], payload: bytes) -> dict[str, Any]:
        import torch

        k = header.get("partition")
        last = self.num_steps - 1
        if isinstance(k, bool) or not isinstance(k, int) or not -1 <= k < last:
            raise AnytimeError(f"partition {k!r} does not exist; the server finishes partitions -1..{last - 1}")
        shape = header.get("shape")
        if not isinstance(shape, list) or [*shape[1:]] != list(self.shapes[k]):
            raise AnytimeError(f"a tensor of shape {shape} was sent for partition {k}, whose activation is "
                               f"[N, {', '.join(str(s) for s in self.shapes[k])}]")  # fmt: skip
        if not isinstance(shape[0], int) or not 1 <= shape[0] <= self.max_batch:
            raise AnytimeError(f"batch {shape[0]!r} is not between 1 and {self.max_batch}")
        thresholds = header.get("thresholds")
        policy = ExitPolicy.from_dict({"criterion": header.get("criterion", "entropy"), "thresholds": thresholds},
                                      where="the request's exit policy")  # fmt: skip
        if policy.num_steps != self.num_steps:
            raise AnytimeError(
                f"the request has thresholds for {policy.num_steps} exits; the model has {self.num_steps}"
            )
        h = decode({"codec": header.get("codec"), "shape": shape}, payload)
        if not torch.isfinite(h).all():
            raise AnytimeError("the tensor holds NaN or infinite values")
        start = self._clock()
        with self._lock, torch.inference_mode():
            exits = torch.full((h.shape[0],), last, dtype=torch.long)
            answer = torch.zeros(h.shape[0], dtype=torch.long)
            pending = torch.ones(h.shape[0], dtype=torch.bool)
            for j in range(k + 1, last + 1):
                h = self.segments[j](h)
                if j == last:
                    answer[pending] = h.argmax(dim=1)[pending]
                    break
                if policy.thresholds[j] is None:
                    continue
                logits = self.heads[j](h)
                leave = policy.confident(j, logits)
                assert leave is not None
                now = leave & pending
                answer[now] = logits.argmax(dim=1)[now]
                exits[now] = j
                pending &= ~leave
                if not bool(pending.any()):
                    break
        compute_ms = (self._clock() - start) * 1000
        return {"ok": True, "id": header.get("id"), "exit": exits.tolist(), "prediction": answer.tolist(),
                "compute_ms": round(compute_ms, 4)}  # fmt: skip


class _Handler(socketserver.BaseRequestHandler):
    server: _TCPServer

    def handle(self) -> None:
        import socket

        sock = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        service = self.server.service
        while True:
            try:
                header, payload = read_frame(sock, self.server.max_payload)
            except ValueError as exc:
                try:
                    sock.sendall(frame({"ok": False, "error": f"{exc}; the connection is closed"}))
                except OSError:
                    pass
                return
            except (OSError, ConnectionError):
                return
            reply = service.handle(header, payload)
            try:
                sock.sendall(frame(reply))
            except OSError:
                return
            collect_due()  # after the reply, before the next request arrives


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], service: SplitService, max_payload: int) -> None:
        self.service = service
        self.max_payload = max_payload
        super().__init__(address, _Handler)


class SplitServer:
    """A TCP server around a :class:`SplitService` (one thread per connection, one model call at a time)."""

    def __init__(self, service: SplitService, host: str = "127.0.0.1", port: int = 0, *,
                 max_payload: int = 64 << 20) -> None:  # fmt: skip
        if not 0 <= port <= 65535:
            raise AnytimeError(f"--port {port} is not a port number (0-65535)")
        try:
            self._server = _TCPServer((host, port), service, max_payload)
        except (OSError, UnicodeError) as exc:
            raise AnytimeError(
                f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --port"
            ) from None
        self.service = service

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) it listens on (the port the system chose when 0 was asked)."""
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def serve_forever(self) -> None:
        """Serve until :meth:`shutdown`."""
        self._server.serve_forever(poll_interval=0.2)

    def start(self) -> threading.Thread:
        """Serve on a background thread (tests, benchmarks)."""
        thread = threading.Thread(target=self.serve_forever, daemon=True)
        thread.start()
        return thread

    def shutdown(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()
