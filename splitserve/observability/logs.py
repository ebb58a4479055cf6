"""Process logs on stderr, as text or as JSON lines (``SPLITSERVE_LOG_FORMAT``).

A JSON line carries the trace and span ids of the span current where the line was logged, in
the hex form trace viewers show (Jaeger, Tempo, ``splitserve traces``), so a log search and a
trace lead to each other. A log collector (Loki, Fluent Bit, Cloud Logging) reads one object a
line; the fields are ``time`` (UTC, ISO 8601), ``level``, ``role``, ``logger``, ``message``,
``trace_id`` and ``span_id`` (when a span is current) and ``exception`` (when one is logged).
"""

from __future__ import annotations

import datetime
import json
import logging
import sys

from opentelemetry import trace

LOG_FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str):
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "role": self.role,
            "logger": record.name,
            "message": record.getMessage(),
        }
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            out["trace_id"] = trace.format_trace_id(ctx.trace_id)
            out["span_id"] = trace.format_span_id(ctx.span_id)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(role: str, log_format: str = "text") -> None:
    """INFO and above to stderr, in log_format; replaces any handler set before (a process sets
    text first, to report bad settings, then the format its settings name)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be text or json, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter(role))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {role} %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
