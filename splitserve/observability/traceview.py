"""Read the local OTLP-JSON span file and print a request's trace as an indented timeline."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

KIND = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
# Attributes worth a column in the timeline, in this order, with short names.
SHOWN = (
    ("splitserve.request_id", "request"),
    ("gen_ai.request.model", "model"),
    ("gen_ai.usage.input_tokens", "in"),
    ("gen_ai.usage.output_tokens", "out"),
    ("gen_ai.request.max_tokens", "max_tokens"),
    ("gen_ai.response.finish_reasons", "finish"),
    ("splitserve.kv.transport", "transport"),
    ("splitserve.kv.bytes", "bytes"),
    ("splitserve.kv.gbps", "GB/s"),
    ("splitserve.batch.sequences", "seqs"),
    ("splitserve.batch.tokens", "tokens"),
    ("splitserve.prefix_cache.tokens", "cached"),
    ("splitserve.queue.requests", "queued"),
    ("splitserve.admitted", "admitted"),
    ("splitserve.decode.max_token_gap_ms", "max_gap_ms"),
    ("splitserve.decode.preemptions", "preempted"),
)
GRPC_CODES = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
]


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    service: str
    kind: str
    start_ns: int
    end_ns: int
    attrs: dict
    status: str = ""  # "", "OK", "ERROR: ..."
    events: list = field(default_factory=list)
    links: list = field(default_factory=list)

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(v: dict):
    if "stringValue" in v:
        return v["stringValue"]
    if "intValue" in v:
        return int(v["intValue"])
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "boolValue" in v:
        return bool(v["boolValue"])
    if "arrayValue" in v:
        return [_value(x) for x in v["arrayValue"].get("values", [])]
    return None


def _attrs(items) -> dict:
    return {a["key"]: _value(a.get("value", {})) for a in items or []}


def load_spans(path: str) -> list[Span]:
    """The spans in an OTLP-JSON span file, after those of its rotated predecessor ``<path>.1``."""
    spans = []
    for p in (path + ".1", path):
        try:
            with open(p) as f:
                spans += _parse(f)
        except FileNotFoundError:
            if p == path:
                raise
    return spans


def _parse(lines: Iterable[str]) -> list[Span]:
    spans = []
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a killed process
        for rs in doc.get("resourceSpans", []):
            res = _attrs(rs.get("resource", {}).get("attributes"))
            service = res.get("service.name", "?")
            if res.get("service.instance.id"):
                service = f"{service}[{res['service.instance.id']}]"
            for ss in rs.get("scopeSpans", []):
                for s in ss.get("spans", []):
                    st = s.get("status", {})
                    code = st.get("code", "")
                    status = {"STATUS_CODE_OK": "OK", "STATUS_CODE_ERROR": "ERROR", 1: "OK", 2: "ERROR"}.get(code, "")
                    if status == "ERROR" and st.get("message"):
                        status += ": " + st["message"]
                    spans.append(
                        Span(
                            trace_id=s["traceId"],
                            span_id=s["spanId"],
                            parent_id=s.get("parentSpanId", ""),
                            name=s["name"],
                            service=service,
                            kind=KIND.get(_kind(s.get("kind")), "internal"),
                            start_ns=int(s["startTimeUnixNano"]),
                            end_ns=int(s["endTimeUnixNano"]),
                            attrs=_attrs(s.get("attributes")),
                            status=status,
                            events=[(int(e["timeUnixNano"]), e["name"]) for e in s.get("events", [])],
                            links=[(ln["traceId"], ln["spanId"]) for ln in s.get("links", [])],
                        )
                    )
    return spans


def _kind(k) -> int:
    if isinstance(k, int):
        return k
    names = {
        "SPAN_KIND_INTERNAL": 1,
        "SPAN_KIND_SERVER": 2,
        "SPAN_KIND_CLIENT": 3,
        "SPAN_KIND_PRODUCER": 4,
        "SPAN_KIND_CONSUMER": 5,
    }
    return names.get(k or "", 1)


def group_traces(spans: list[Span]) -> dict[str, list[Span]]:
    traces: dict[str, list[Span]] = {}
    for s in spans:
        traces.setdefault(s.trace_id, []).append(s)
    return traces


def request_traces(spans: list[Span]) -> dict[str, list[Span]]:
    """Traces that carry a request (not the prefill worker's batch-only traces)."""
    return {t: ss for t, ss in group_traces(spans).items() if any("splitserve.request_id" in s.attrs for s in ss)}


def find(spans: list[Span], request_id: str | None = None, last: int = 1) -> list[list[Span]]:
    traces = request_traces(spans)
    if request_id:
        return [ss for ss in traces.values() if any(s.attrs.get("splitserve.request_id") == request_id for s in ss)]
    ordered = sorted(traces.values(), key=lambda ss: min(s.start_ns for s in ss))
    return ordered[-last:] if last > 0 else ordered


def status_of(s: Span) -> str:
    code = s.attrs.get("rpc.grpc.status_code")
    if s.status.startswith("ERROR"):
        return s.status
    if isinstance(code, int) and code != 0:
        return GRPC_CODES[code] if code < len(GRPC_CODES) else str(code)
    return ""


def render(trace: list[Span], batches: dict[str, Span] | None = None) -> str:
    """An indented timeline: offset and duration (ms), span, process, key attributes."""
    by_id = {s.span_id: s for s in trace}
    children: dict[str, list[Span]] = {}
    roots = []
    for s in trace:
        if s.parent_id and s.parent_id in by_id:
            children.setdefault(s.parent_id, []).append(s)
        else:
            roots.append(s)
    t0 = min(s.start_ns for s in trace)
    rid = next((s.attrs["splitserve.request_id"] for s in trace if "splitserve.request_id" in s.attrs), "?")
    lines = [
        f"trace {trace[0].trace_id}  request {rid}  ({len(trace)} spans, "
        f"{(max(s.end_ns for s in trace) - t0) / 1e6:.1f} ms)"
    ]
    # A span reaches the file once it has ended (and its process's next export, within half a
    # second): a request still running, or one that just ended, shows without its router's span.
    orphans = sum(1 for s in trace if s.parent_id and s.parent_id not in by_id)
    if orphans:
        lines.append(
            f"incomplete: {orphans} span(s) below have their parent missing from the file: it has not "
            "ended (the request is still running: `splitserve request ID` says where it is) or was not "
            "written yet (a process writes the spans that ended every 0.5 s by default); run this again"
        )
    lines.append(f"{'start ms':>10} {'dur ms':>10}  span")

    def walk(s: Span, depth: int) -> None:
        extra = [
            f"{short}={_fmt(s.attrs[key])}"
            for key, short in SHOWN
            if key in s.attrs and not (key == "splitserve.request_id" and depth)
        ]
        st = status_of(s)
        if st:
            extra.append(f"status={st}")
        lines.append(
            f"{(s.start_ns - t0) / 1e6:10.1f} {s.duration_ms:10.1f}  {'  ' * depth}{s.name} "
            f"[{s.service}] {' '.join(extra)}".rstrip()
        )
        for ts, name in s.events:
            lines.append(f"{(ts - t0) / 1e6:10.1f} {'':>10}  {'  ' * (depth + 1)}* {name}")
        for b in (batches or {}).get(s.span_id, []):
            lines.append(
                f"{(b.start_ns - t0) / 1e6:10.1f} {b.duration_ms:10.1f}  {'  ' * (depth + 1)}~ {b.name} "
                f"[{b.service}] seqs={b.attrs.get('splitserve.batch.sequences')} "
                f"tokens={b.attrs.get('splitserve.batch.tokens')} (linked batch)"
            )
        for c in sorted(children.get(s.span_id, []), key=lambda c: c.start_ns):
            walk(c, depth + 1)

    for r in sorted(roots, key=lambda s: s.start_ns):
        walk(r, 0)
    if (line := summary(trace)) is not None:
        lines.append(line)
    return "\n".join(lines)


# The spans on a request's way to its first token, in order; each one's first (a resumed request
# has one a leg). Colocated, the decode worker prefills: admission, then "to its first token".
TTFT_PARTS = ("admission", "queue wait", "prefill")
GAP = "splitserve.decode.max_token_gap_ms"


def summary(trace: list[Span]) -> str | None:
    """Where a request's time went, in a line: its TTFT by the spans on the way to its first
    token, and its tokens after it. None without its router's span (not in the file yet)."""
    root = next((s for s in trace if not s.parent_id and s.name.startswith("splitserve.v1.Generation/")), None)
    if root is None:
        return None
    first = next((t for t, name in root.events if name == "first_token"), None)
    if first is None:
        status = status_of(root)
        return f"summary: no token sent in {root.duration_ms:.1f} ms" + (f" ({status})" if status else "")
    ttft = (first - root.start_ns) / 1e6
    # Each part runs from the end of the one before (contiguous: they add up) to the start of the
    # next: the admission span goes on past the job's queueing (it waits for the decode worker to
    # accept the stream) while the job waits and is prefilled; the last one, to its own end.
    found = [min(got, key=lambda s: s.start_ns) for name in TTFT_PARTS if (got := [s for s in trace if s.name == name])]
    parts, since = [], root.start_ns
    for span, after in zip(found, [*found[1:], None]):
        end = max(since, after.start_ns if after is not None else span.end_ns)
        parts.append((span.name, (end - since) / 1e6))
        since = end
    parts.append(("the rest" if len(parts) == len(TTFT_PARTS) else "to its first token", (first - since) / 1e6))
    line = f"summary: TTFT {ttft:.1f} ms ({', '.join(f'{name} {ms:.1f}' for name, ms in parts)})"
    tokens, after = root.attrs.get("gen_ai.usage.output_tokens"), (root.end_ns - first) / 1e6
    if isinstance(tokens, int) and tokens > 1:
        samples = root.attrs.get("gen_ai.request.choice.count", 1)
        each = after / max(1, -(-tokens // samples) - 1)  # a sample's tokens after its first, side by side
        line += (
            f"; {tokens} tokens"
            + (f" over {samples} samples" if samples > 1 else "")
            + f", the last {after:.1f} ms after the first ({each:.1f} ms a token)"
        )
    decode = [s for s in trace if s.name == "decode"]
    gaps = [s.attrs[GAP] for s in decode if GAP in s.attrs]
    preempted = sum(s.attrs.get("splitserve.decode.preemptions", 0) for s in decode)
    if gaps:
        line += f"; longest gap {max(gaps):.1f} ms"
    if preempted:
        line += f"; preempted {preempted}x"
    return line


def linked_batches(spans: list[Span]) -> dict[str, list[Span]]:
    """span id -> batch spans that link to it."""
    out: dict[str, list[Span]] = {}
    for s in spans:
        for _, sid in s.links:
            out.setdefault(sid, []).append(s)
    return out


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, list):
        return ",".join(str(x) for x in v)
    return str(v)
