"""OpenTelemetry tracing, set up once per process from the standard ``OTEL_*`` variables.

Where spans go:

- ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``: nowhere (no SDK installed;
  the API's no-op tracer costs nothing);
- ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` set: OTLP,
  over gRPC unless ``OTEL_EXPORTER_OTLP_PROTOCOL`` (or the traces variant) says
  ``http/protobuf``;
- otherwise ``SPLITSERVE_TRACE_FILE`` (``splitserve up`` sets one per stack): OTLP-JSON,
  one ``ExportTraceServiceRequest`` per line, appended by every process of the stack;
- otherwise ``OTEL_TRACES_EXPORTER=console`` prints spans; anything else: no tracing.

Sampling (``OTEL_TRACES_SAMPLER``/``_ARG``), resource attributes
(``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_SERVICE_NAME``) and batching (``OTEL_BSP_*``) are
the SDK's own. Context crosses processes as W3C ``traceparent``: in gRPC metadata, in
the Redis job and in the KV handoff's ``SequenceState``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from splitserve.observability import otlp_json

log = logging.getLogger(__name__)

# The OTEL_* variables this code (and the SDK it configures) reads; the deploy tests
# accept these in manifests.
OTEL_ENV = (
    "OTEL_SDK_DISABLED",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_EXPORTER_OTLP_INSECURE",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_PROPAGATORS",
    "OTEL_BSP_SCHEDULE_DELAY",
    "OTEL_BSP_MAX_QUEUE_SIZE",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
    "OTEL_BSP_EXPORT_TIMEOUT",
)
TRACER_NAME = "splitserve"

_provider = None
_lock = threading.Lock()

__all__ = [
    "Link",
    "SpanKind",
    "Status",
    "StatusCode",
    "setup_tracing",
    "shutdown_tracing",
    "tracer",
    "inject",
    "extract",
    "traceparent_of",
    "context_of",
    "ns",
    "enabled",
]


def _truthy(v: str | None) -> bool:
    return (v or "").strip().lower() in ("1", "true", "yes", "on")


def exporter_kind(environ=None, trace_file: str = "") -> str:
    """otlp-grpc, otlp-http, file, console or none."""
    env = os.environ if environ is None else environ
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if _truthy(env.get("OTEL_SDK_DISABLED")) or names == ["none"]:
        return "none"
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        proto = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
        return "otlp-http" if proto.startswith("http") else "otlp-grpc"
    if trace_file:
        return "file"
    if "console" in names:
        return "console"
    return "none"


def setup_tracing(role: str, instance: str = "", trace_file: str = "", trace_file_max_bytes: int = 0) -> str:
    """Install the SDK for this process (once); returns the exporter kind in use."""
    global _provider
    with _lock:
        if _provider is not None:
            return "already"
        kind = exporter_kind(trace_file=trace_file)
        if kind == "none":
            return kind
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

        attrs = {"splitserve.role": role}
        if instance:
            attrs["service.instance.id"] = instance
        if not os.environ.get("OTEL_SERVICE_NAME"):
            attrs["service.name"] = f"splitserve-{role}"
        provider = TracerProvider(resource=Resource.create(attrs))
        if kind == "otlp-grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        elif kind == "otlp-http":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        elif kind == "file":
            exporter = JsonFileSpanExporter(trace_file, trace_file_max_bytes)
        else:
            exporter = ConsoleSpanExporter()
        delay = None if os.environ.get("OTEL_BSP_SCHEDULE_DELAY") else (500 if kind == "file" else None)
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=delay))
        trace.set_tracer_provider(provider)
        _provider = provider
        log.info("tracing: %s%s", kind, f" -> {trace_file}" if kind == "file" else "")
        return kind


def shutdown_tracing() -> None:
    """Flush and stop the exporter (call on the way out)."""
    global _provider
    with _lock:
        if _provider is not None:
            _provider.shutdown()
            _provider = None


def enabled() -> bool:
    return _provider is not None


_tracer: tuple = (None, None)  # (the provider, its tracer)


def tracer() -> trace.Tracer:
    """This process's tracer, made once per provider (get_tracer builds a new one at each call)."""
    global _tracer
    provider = trace.get_tracer_provider()
    if _tracer[0] is not provider:
        _tracer = (provider, provider.get_tracer(TRACER_NAME))
    return _tracer[1]


# -- propagation ----------------------------------------------------------------------------


def inject(ctx=None) -> list[tuple[str, str]]:
    """The context (default: current) as gRPC metadata pairs."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return list(carrier.items())


def extract(metadata) -> otel_context.Context:
    """A context from gRPC invocation metadata (pairs or a dict)."""
    carrier = dict(metadata or ())
    return propagate.extract(carrier)


def traceparent_of(span) -> str:
    """The W3C traceparent of a span ('' when not recording)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def context_of(traceparent: str) -> otel_context.Context:
    return propagate.extract({"traceparent": traceparent} if traceparent else {})


def ns(unix_seconds: float) -> int:
    return int(unix_seconds * 1e9)


# -- the local span file ------------------------------------------------------------------------


class JsonFileSpanExporter:
    """Appends OTLP-JSON lines to a file shared by every process of a stack (O_APPEND, one write per batch).

    With ``max_bytes``, the file is capped: the process whose write takes it to the cap renames
    it to ``<path>.1`` (replacing the one before) and starts a new one, so a stack that serves for
    days keeps at most about twice the cap on disk. The others notice the new file (another inode
    at the path) before their next write and reopen. The rename happens under an exclusive flock on
    the full file, so of two processes that reach the cap together only one renames it.
    """

    def __init__(self, path: str, max_bytes: int = 0):
        self.path = path
        self.old_path = path + ".1"
        self.max_bytes = max_bytes
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._fd = -1
        self._lock = threading.Lock()  # export and shutdown may come from different threads
        self._encoder = otlp_json.Encoder()
        self._open()

    def _open(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = fd

    def _current(self) -> bool:
        """Whether the path still names the file this exporter writes (no rotation since it opened it)."""
        try:
            return os.stat(self.path).st_ino == os.fstat(self._fd).st_ino
        except FileNotFoundError:  # rotated and its successor not created yet, or removed
            return False

    def _follow(self) -> None:
        """Reopen when another process has rotated the file."""
        if not self._current():
            self._open()

    def _rotate(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            if self._current():  # not rotated meanwhile by a process that held the lock before us
                os.replace(self.path, self.old_path)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._open()

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        try:
            line = (json.dumps(self._encoder.request(spans), separators=(",", ":")) + "\n").encode()
            with self._lock:
                if self._fd < 0:
                    return SpanExportResult.FAILURE
                self._follow()  # whatever its own cap, a file rotated by another process is left
                os.write(self._fd, line)
                if self.max_bytes and os.fstat(self._fd).st_size >= self.max_bytes:
                    self._rotate()
            return SpanExportResult.SUCCESS
        except Exception:  # noqa: BLE001 - losing spans must not lose the process
            log.exception("writing spans to %s failed", self.path)
            return SpanExportResult.FAILURE

    def shutdown(self):
        with self._lock:
            if self._fd >= 0:
                try:
                    os.close(self._fd)
                except OSError:
                    pass
                self._fd = -1

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


# -- RPC spans ----------------------------------------------------------------------------------

# Server spans: these codes are the server's fault (OpenTelemetry's RPC conventions);
# the others (cancelled, invalid argument, resource exhausted, ...) leave the status unset.
SERVER_FAULTS = {"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"}


def rpc_attributes(full_method: str) -> dict:
    service, _, method = full_method.lstrip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


class rpc_span:
    """A span for one RPC: children get ``.ctx`` explicitly, since it lives across the yields of
    async generators. A server's span is also made current in its call's task, never detached
    (the task, one per call on the asyncio server, ends with the call), so the call's log lines
    carry its trace id (logs.py). On the way out it records ``rpc.grpc.status_code`` and, for
    server faults, an error status."""

    def __init__(self, name: str, *, kind=SpanKind.SERVER, parent=None, attributes=None, start_time=None):
        self.span = tracer().start_span(name, context=parent, kind=kind, attributes=attributes, start_time=start_time)
        self.ctx = trace.set_span_in_context(self.span)
        self.kind = kind
        self.code = None  # set by the body to override the exception mapping

    def __enter__(self) -> rpc_span:
        if self.kind == SpanKind.SERVER:
            otel_context.attach(self.ctx)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        from splitserve.service.errors import code_of

        span = self.span
        if exc is not None and not isinstance(exc, GeneratorExit):
            code = code_of(exc)
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code.name in SERVER_FAULTS or self.kind != SpanKind.SERVER:
                if code.name != "CANCELLED":
                    span.set_status(Status(StatusCode.ERROR, f"{code.name}: {exc}"[:300]))
            if code.name == "CANCELLED":
                span.add_event("cancelled")
        elif isinstance(exc, GeneratorExit):  # the client went away between messages
            span.set_attribute("rpc.grpc.status_code", 1)
            span.add_event("cancelled")
        else:
            span.set_attribute("rpc.grpc.status_code", 0)
        span.end()
