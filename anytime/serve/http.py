"""``anytime serve``'s HTTP endpoint: FastAPI on uvicorn (``anytime[serve]``), over :class:`Service`.

Routes: ``POST /predict`` (an image or ``.npy`` array, or for a text run a sentence, with a deadline and optionally
an energy budget ``energy_mj``; as the body, a form field or a JSON object), ``GET /schedule?deadline_ms=D[&energy_mj=E]
[&length=T]``,
``GET /healthz`` and ``GET /metrics`` (Prometheus). Every refusal is a 4xx JSON ``{"error": "one sentence"}``;
the server never reads a path or unpickles anything a client sends.
"""

# FastAPI reads the routes' annotations at run time, so they are not postponed (no __future__ annotations).
import asyncio
import contextlib
import email.parser
import email.policy
import json
import math
import os
import re
import socket
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from anytime.data.inputs import Inputs, InputSpec, TextSpec
from anytime.errors import AnytimeError, BadRequest
from anytime.profile.stats import quantile_of
from anytime.serve.cooperate import DEFAULT_EVERY_MS
from anytime.serve.service import Request, Service, parse_deadline, parse_energy_budget
from anytime.utils.jsonsafe import loads_bounded

ROUTES = "POST /predict, GET /schedule?deadline_ms=D, GET /healthz, GET /metrics"
MAX_FORM_PARTS = 16  # the image or sentence, deadline_ms, energy_mj, cheapest, and room to spare
BODY_TIMEOUT_S = 10.0  # a body not finished within this is answered 408 (a stalled client holds nothing longer)
DRAIN_LIMIT = 8 << 20  # an oversized body is read and dropped up to this many bytes, so the client sees the 413
MAX_CONNECTIONS = 512  # open connections and tasks beyond which uvicorn answers 503 at once
SERVER_SETTINGS = {"http": "anytime.serve.protocol:HeaderDeadline", "limit_concurrency": MAX_CONNECTIONS}  # uvicorn's
_BOUNDARY = re.compile(r'boundary="?([^";]+)"?', re.IGNORECASE)
_TRUE = ("1", "true", "yes", "on")
ENVIRONMENT = "ANYTIME_SERVE"  # how `--workers N` hands its options to each worker process


@dataclass(frozen=True)
class ServeOptions:
    """What ``anytime serve`` was asked for."""

    run: str
    profile: str | None = None
    calibration: str | None = None
    max_batch: int | None = None
    max_body_kb: int = 1024
    quantile: float = 0.99
    threads: int | str | None = None  # a number, 'auto', or None: the profile's
    device: str = "auto"
    yield_ms: float = DEFAULT_EVERY_MS


def _multipart_fields(body: bytes, content_type: str, field: str) -> dict[str, bytes]:
    try:
        content_type.encode("latin-1")  # what HTTP headers are; an ASGI server hands nothing else on
    except UnicodeEncodeError:
        raise BadRequest("the Content-Type header is not latin-1 text") from None
    found = _BOUNDARY.search(content_type)
    if found is None:
        raise BadRequest(f"the multipart body has no boundary: send the {field} in a form field named '{field}'")
    parts = body.count(b"--" + found.group(1).encode("latin-1")) - 1
    if parts > MAX_FORM_PARTS:  # the parser's cost grows with the parts, and it runs on the event loop
        raise BadRequest(f"the form has {parts} parts; at most {MAX_FORM_PARTS} are read")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        f"Content-Type: {content_type}\r\n\r\n".encode("latin-1") + body
    )
    if not message.is_multipart():
        raise BadRequest(f"malformed multipart body: send the {field} in a form field named '{field}'")
    fields: dict[str, bytes] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            payload = part.get_payload(decode=True)
            fields[name] = payload if isinstance(payload, bytes) else b""
    return fields


def _json_fields(body: bytes, field: str) -> dict[str, bytes]:
    """A JSON object's fields as the form's would be (numbers and booleans as their text); ``field`` must be text."""
    try:
        doc = loads_bounded(body)
    except ValueError as exc:
        raise BadRequest(f'{exc}: send {{"{field}": ..., "deadline_ms": 10}}') from None
    if not isinstance(doc, dict):
        raise BadRequest(f'the JSON body must be an object: {{"{field}": ..., "deadline_ms": 10}}')
    if field == "image" and "image" in doc:
        raise BadRequest(
            "images are not sent in JSON: send the PNG, JPEG or .npy bytes as the body or a form field", 415
        )
    fields = {}
    for key, value in doc.items():
        if key == field and not isinstance(value, str):
            raise BadRequest(f"'{field}' must be a string")
        if isinstance(value, bool):
            value = "true" if value else "false"
        if value is not None:
            fields[key] = str(value).encode()
    return fields


def create_app(service: Service, spec: Inputs,
               schedule: Callable[[float, float, int, float | None, int | None], dict[str, Any]],
               *, info: dict[str, Any], max_body_bytes: int) -> Any:  # fmt: skip
    """The FastAPI application over a started ``service``; ``schedule(deadline_ms, quantile, batch, energy_mj,
    length)`` answers ``GET /schedule`` (as ``anytime schedule``)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse

    app = FastAPI(title="anytime", description=f"Anytime inference under deadlines for {info.get('run')}",
                  version=str(info.get("version")), docs_url=None, redoc_url=None)  # fmt: skip
    _add_refusals(app, service)
    _add_predict(app, service, spec, _body_reader(max_body_bytes))

    @app.get("/schedule")
    async def schedule_route(deadline_ms: str | None = None, quantile: float | None = None, batch_size: int = 1,
                             energy_mj: str | None = None, length: int | None = None) -> JSONResponse:  # fmt: skip
        """The step or policy that meets the deadline on the profiled device, as ``anytime schedule`` (by default
        at the server's ``--quantile``; a text run's ``length``: the request's tokens, default its longest)."""
        if quantile is None:
            quantile = float(info.get("quantile", 0.99))
        if not (math.isfinite(quantile) and 0 < quantile <= 1):
            raise BadRequest(f"quantile {quantile} must be in (0, 1]")
        if length is not None and (spec.field != "text" or length < 1):
            raise BadRequest("length is a text run's number of tokens (a whole number, at least 1)")
        return JSONResponse(schedule(parse_deadline(deadline_ms), quantile, batch_size, parse_energy_budget(energy_mj),
                                     length))  # fmt: skip

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        """Liveness, with what is served."""
        return JSONResponse({"status": "ok", **info, "queue_depth": service.queue_depth})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        """Prometheus text: requests, misses, bad requests, latency per step, drift, queue depth."""
        return PlainTextResponse(service.metrics.render(service.queue_depth),
                                 media_type="text/plain; version=0.0.4")  # fmt: skip

    return ArrivalStamp(app, service.clock)


def _add_refusals(app: Any, service: Service) -> None:
    """Every refusal as a one-line JSON error with its 4xx status (counted in the metrics); anything else as a 500
    that says what failed."""
    from fastapi import Request as HttpRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    def refuse(status: int, message: str) -> JSONResponse:
        service.metrics.bad_request(status)
        return JSONResponse({"error": message}, status_code=status)

    @app.exception_handler(HTTPException)
    async def _http_error(request: HttpRequest, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return refuse(404, f"no route {request.url.path}; the server answers {ROUTES}")
        if exc.status_code == 405:
            return refuse(405, f"{request.method} is not allowed on {request.url.path}; the server answers {ROUTES}")
        return refuse(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return refuse(400, f"invalid {where or 'request'}: {first.get('msg', 'malformed')}")

    @app.exception_handler(BadRequest)
    async def _bad(request: HttpRequest, exc: BadRequest) -> JSONResponse:
        return refuse(exc.status, str(exc))

    @app.exception_handler(AnytimeError)
    async def _refused(request: HttpRequest, exc: AnytimeError) -> JSONResponse:
        return refuse(400, str(exc))

    @app.exception_handler(Exception)
    async def _failed(request: HttpRequest, exc: Exception) -> JSONResponse:
        service.metrics.bad_request(500)  # counted with the refusals, by its status code
        return JSONResponse({"error": f"the server failed to answer ({type(exc).__name__}: {str(exc)[:200]})"},
                            status_code=500)  # fmt: skip


def _body_reader(max_body_bytes: int) -> Callable[[Any], Awaitable[bytes]]:
    """What reads a request's body: at most ``max_body_bytes`` (413 beyond, the rest drained so the client reads
    it), within :data:`BODY_TIMEOUT_S` (408 after)."""
    from fastapi import Request as HttpRequest

    async def drain(stream: Any, read: int) -> None:
        """Read and drop what is left of an oversized body, up to a bound, so that a client still sending it
        reads the 413 instead of a reset connection."""
        with contextlib.suppress(Exception):
            async for chunk in stream:
                read += len(chunk)
                if read > DRAIN_LIMIT:
                    break

    async def read_chunks(request: HttpRequest) -> bytes:
        declared = request.headers.get("content-length")
        stream = request.stream()
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            if int(declared) <= DRAIN_LIMIT:
                await drain(stream, 0)
            raise BadRequest(f"the body is {int(declared)} bytes; the limit is {max_body_bytes} (--max-body-kb)", 413)
        chunks, size = [], 0
        async for chunk in stream:
            size += len(chunk)
            if size > max_body_bytes:
                await drain(stream, size)
                raise BadRequest(f"the body is over the limit of {max_body_bytes} bytes (--max-body-kb)", 413)
            chunks.append(chunk)
        return b"".join(chunks)

    async def read_body(request: HttpRequest) -> bytes:
        try:
            if hasattr(asyncio, "timeout"):  # Python 3.11: no task per request, unlike wait_for
                async with asyncio.timeout(BODY_TIMEOUT_S):
                    return await read_chunks(request)
            return await asyncio.wait_for(read_chunks(request), BODY_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise BadRequest(f"the body did not arrive within {BODY_TIMEOUT_S:g} s", 408) from None

    return read_body


def _add_predict(app: Any, service: Service, spec: Inputs, read_body: Callable[[Any], Awaitable[bytes]]) -> None:
    """``POST /predict``: one input answered within its deadline."""
    from fastapi import Request as HttpRequest
    from fastapi.responses import JSONResponse

    @app.post("/predict")
    async def predict(request: HttpRequest) -> JSONResponse:
        """Answer one input (an image or array, or a sentence) within its deadline (queue time counted)."""
        arrived = request.scope.get(ARRIVED, service.clock())
        body = await read_body(request)
        content_type = request.headers.get("content-type", "")
        field = spec.field
        fields: dict[str, bytes] = {}
        if content_type.startswith(("multipart/form-data", "application/json")):
            if content_type.startswith("multipart/form-data"):
                fields = _multipart_fields(body, content_type, field)
            else:
                fields = _json_fields(body, field)
            if field not in fields:
                example = "-F image=@picture.png -F deadline_ms=10" if field == "image" else (
                    '{"text": "a sentence", "deadline_ms": 10}')  # fmt: skip
                raise BadRequest(f"the request has no '{field}' field: send {example}")
            body = fields[field]
        elif field == "image" and content_type.startswith("text/"):
            raise BadRequest(f"a {content_type.split(';')[0]} body is not an image: send PNG, JPEG or .npy bytes", 415)
        text = {k: v.decode("utf-8", "replace") for k, v in fields.items() if k != field}
        deadline = parse_deadline(text.get("deadline_ms") or request.query_params.get("deadline_ms")
                                  or request.headers.get("x-deadline-ms"))  # fmt: skip
        cheapest = (text.get("cheapest") or request.query_params.get("cheapest") or "").lower() in _TRUE or (
            request.headers.get("x-on-miss", "").lower() == "cheapest")  # fmt: skip
        energy = parse_energy_budget(text.get("energy_mj") or request.query_params.get("energy_mj")
                                     or request.headers.get("x-energy-mj"))  # fmt: skip
        if energy is not None and service.runner.profile.energy is None:
            raise BadRequest("this server's profile has no energy figures: drop energy_mj, or serve a profile measured "
                             "with `anytime profile RUN --energy`")  # fmt: skip
        decoded = spec.decode(body)
        answer = await asyncio.wrap_future(service.submit(Request(decoded, deadline, arrived, cheapest, energy)))
        return JSONResponse(answer.to_dict())


ARRIVED = "anytime.arrived"  # the ASGI scope key holding when a request reached the application (service clock, s)


class ArrivalStamp:
    """ASGI middleware that stamps every request with the service clock the moment the server hands it to the
    application (its headers parsed, before routing and the body): the earliest hook the server stack offers, so
    that a request's deadline counts the routing, the body's reading and the decoding too."""

    def __init__(self, app: Any, clock: Callable[[], float]) -> None:
        self.app = app
        self.clock = clock

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") == "http":
            scope[ARRIVED] = self.clock()
        await self.app(scope, receive, send)


def build_app(options: ServeOptions) -> tuple[Any, Service]:
    """Load the run (its model, profile and calibration) and make the application and its started service."""
    from anytime import __version__
    from anytime.scheduler.query import schedule_answer
    from anytime.scheduler.runs import open_for_answers
    from anytime.train.splits import run_tokenizer

    if options.max_body_kb < 1:
        raise AnytimeError(f"--max-body-kb must be at least 1 (got {options.max_body_kb})")
    opened = open_for_answers(options.run, options.profile, calibration=options.calibration,
                              quantile=options.quantile, device=options.device, threads=options.threads)  # fmt: skip
    runner, run = opened.runner, opened.run
    if runner.profile.serving is not None:  # what the HTTP stack adds beyond the server's count, kept free
        runner.margin_ms = quantile_of(runner.profile.serving, options.quantile)
    text = run.dataset.get("modality") == "text"
    spec: Inputs = (
        TextSpec.from_tokenizer(run_tokenizer(options.run), run.dataset, options.run)
        if text
        else InputSpec.from_dataset(run.dataset)
    )
    service = Service(runner, step_names=runner.profile.step_names, class_names=spec.class_names,
                      max_batch=options.max_batch, yield_ms=options.yield_ms)  # fmt: skip
    # One scheduler per profile the runtime holds (a text run: per length bucket), built from the profiles it loaded.
    schedulers = {bucket: opened.scheduler(bucket) for bucket in [None, *runner.length_profiles]}
    info = {"run": str(Path(options.run)), "model": run.name, "profile": str(opened.profile_path),
            "version": __version__, "steps": list(runner.profile.step_names),
            "policy": runner.policy.to_dict() if runner.policy else None, "input": spec.describe(),
            "max_batch": service.max_batch, "quantile": options.quantile,
            "serving_overhead_ms": runner.margin_ms}  # fmt: skip
    if text and runner.length_profiles:
        info["length_buckets"] = sorted(runner.length_profiles)

    def schedule(deadline_ms: float, quantile: float, batch_size: int, energy_mj: float | None,
                 length: int | None) -> dict[str, Any]:  # fmt: skip
        scheduler, path = schedulers[opened.bucket_of(length)]
        # Priced as the runtime prices it here: what the HTTP stack adds is kept free at the end.
        answer = schedule_answer(scheduler, path, max(deadline_ms - runner.margin_ms, 1e-6), quantile, batch_size,
                                 energy_mj=energy_mj)  # fmt: skip
        return {**answer, "deadline_ms": deadline_ms, "serving_overhead_ms": runner.margin_ms}

    with contextlib.suppress(ImportError):  # Pillow's decoders, loaded now rather than by the first image
        from PIL import Image

        Image.preinit()
    service.warm_up(spec.decode(spec.example()))
    service.start()
    app = create_app(service, spec, schedule, info=info, max_body_bytes=1024 * options.max_body_kb)
    return app, service


def app_from_environment() -> Any:
    """The application of one ``--workers`` process (uvicorn's factory), built from ``$ANYTIME_SERVE``."""
    options = ServeOptions(**json.loads(os.environ[ENVIRONMENT]))
    app, _ = build_app(options)
    return app


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` and listening; :class:`AnytimeError` with one sentence otherwise (a port out
    of range, an address that is not this machine's, a port taken)."""
    if not 0 <= port <= 65535:
        raise AnytimeError(f"--port {port} is not a port number (0-65535)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise AnytimeError(f"--host {host} is not an address this machine can listen on ({exc})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise AnytimeError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --host or --port"
        ) from None
    sock.set_inheritable(True)
    return sock


def serve(
    options: ServeOptions, *, host: str, port: int, workers: int = 1, on_ready: Callable[[str], None] | None = None
) -> None:
    """Serve until interrupted; with ``workers`` > 1, that many processes, each with its own model. The address is
    bound before the run is loaded, and ``on_ready`` is told only once both succeeded."""
    try:
        import uvicorn
    except ImportError:
        raise AnytimeError("anytime serve needs FastAPI and uvicorn: pip install 'anytime[serve]'") from None
    sock = listen(host, port)
    bound = sock.getsockname()[1]
    limits = {**SERVER_SETTINGS, "log_level": "warning"}
    try:
        if workers > 1:
            from anytime.utils.threads import choose_threads, usable_cores

            cores = choose_threads().threads if options.threads == "auto" else usable_cores()
            threads = options.threads if isinstance(options.threads, int) else max(1, cores // workers)
            os.environ[ENVIRONMENT] = json.dumps(asdict(ServeOptions(**{**asdict(options), "threads": threads})))
            _, service = build_app(options)  # every error (a missing profile, a bad calibration) here, once
            service.stop()
            if on_ready:
                on_ready(f"http://{host}:{bound} ({workers} workers, {threads} threads each)")
            config = uvicorn.Config("anytime.serve.http:app_from_environment", factory=True, workers=workers, **limits)
            from uvicorn.supervisors import Multiprocess

            Multiprocess(config, sockets=[sock]).run()
            return
        app, service = build_app(options)
        if on_ready:
            on_ready(f"http://{host}:{bound}")
        try:
            uvicorn.Server(uvicorn.Config(app, **limits)).run(sockets=[sock])
        finally:
            service.stop()
    finally:
        sock.close()
