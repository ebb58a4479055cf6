"""The ``splitserve`` command."""

from __future__ import annotations

import argparse
import os
import sys

from splitserve.engine.config import DTYPES, WEIGHTS
from splitserve.engine.errors import EngineError
from splitserve.observability.logs import LOG_FORMATS, setup_logging


def _check_model(args) -> int:
    import time

    from splitserve.engine.config import EngineConfig, ModelSpec
    from splitserve.engine.engine import LLMEngine

    t = time.perf_counter()
    eng = LLMEngine(EngineConfig(model=ModelSpec(path=args.model), kv_cache_bytes=16 << 20))
    s = eng.model.shape
    print(
        f"{eng.model_name}: {s.model_type}, {s.num_layers} layers, hidden {s.hidden_size}, "
        f"{s.num_heads} heads / {s.num_kv_heads} KV heads, vocab {s.vocab_size}, context {eng.max_model_len}, "
        f"fingerprint {eng.fingerprint}, ready in {time.perf_counter() - t:.1f} s"
    )
    return 0


def _at_least(least: int):
    """An argparse type: a whole number >= least (argparse names the flag in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes a whole number, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
        return value

    return parse


def _port(text: str) -> int:
    """An argparse type: a port number (0: as the flag says)."""
    value = _at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {value}")
    return value


def _seconds(text: str) -> float:
    """An argparse type: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def _state_file(name: str = "stack.json") -> str:

    from splitserve.engine.config import default_cache_dir

    return os.path.join(default_cache_dir(), name)


def _read_state(name: str = "stack.json") -> dict | None:
    """What ``splitserve up`` wrote of its stack: the running one's (stack.json, None once the ``up``
    that wrote it is gone, even if killed before it could remove it), or the last one's."""
    import json

    path = _state_file(name)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        state = json.load(f)
    pid = state.get("pid")
    if name == "stack.json" and isinstance(pid, int) and pid > 0:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:  # another user's process: it is there
            pass
    return state


def _up(args) -> int:
    import json
    import signal
    import threading

    from splitserve.service.process import check_port_free
    from splitserve.service.settings import Settings, needs_colocated
    from splitserve.service.tls import check_internal_plaintext
    from splitserve.stack import Stack

    overrides = {"model": args.model, "policy": args.policy, "host": args.host, "dtype": args.dtype}
    overrides["weights"] = args.weights
    overrides["served_model_name"] = args.served_model_name
    overrides["log_format"] = args.log_format
    if args.colocated or needs_colocated(args.policy or ""):
        overrides["mode"] = "colocated"
    try:
        settings = Settings.from_env(**{k: v for k, v in overrides.items() if v})
        for port, flag in ((args.port, "--port"), (args.http_port, "--http-port")):
            check_port_free(settings.host, port, flag)
        if not args.tls:  # (--tls gives every internal server mutual TLS)
            check_internal_plaintext(settings)
    except ValueError as e:
        print(f"splitserve up: error: {e}", file=sys.stderr)
        return 2
    n_prefill = 0 if settings.mode == "colocated" else args.prefill
    stack = Stack(
        settings,
        prefill=n_prefill,
        decode=args.decode,
        routers=args.routers,
        port=args.port,
        http_port=args.http_port,
        tls=args.tls,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: its terminal closed
        if sig != signal.SIGHUP or signal.getsignal(sig) is not signal.SIG_IGN:  # under nohup: left ignored
            signal.signal(sig, lambda *_: stop.set())
    print(
        f"starting: redis ({'external' if settings.redis_url else 'embedded'}), {args.decode} decode worker(s), "
        f"{n_prefill} prefill worker(s), {args.routers} router(s) ...",
        flush=True,
    )
    try:
        stack.start()
        print(f"splitserve is up: router at {', '.join(stack.router_addresses)}  (logs in {stack.run_dir})", flush=True)
        tls_ca = stack.settings.tls_ca or None
        if stack.router_http_address:
            scheme = "https" if tls_ca else "http"
            print(
                f"OpenAI-compatible HTTP: {scheme}://{stack.router_http_address}/v1  (model {_model_name(stack)})",
                flush=True,
            )
        if tls_ca:
            print(
                f"TLS: clients trust {tls_ca}  (splitserve generate --tls-ca, Client(address, tls_ca=...), "
                "curl --cacert)",
                flush=True,
            )
        state = {
            "router": stack.router_address,
            "http": stack.router_http_address,
            "routers": stack.router_addresses,
            "pid": os.getpid(),
            "redis_url": stack.settings.redis_url,
            "redis_prefix": stack.settings.redis_prefix,
            "trace_file": stack.settings.trace_file,
            "run_dir": stack.run_dir,
            "tls_ca": tls_ca,
            "metrics": {p.name: p.metrics_address for p in stack.procs},
        }
        for name in ("stack.json", "last-stack.json"):  # the last one outlives the stack, for `splitserve traces`
            with open(_state_file(name), "w") as f:
                json.dump(state, f)
        if stack.settings.trace_file:
            print(f"traces: {stack.settings.trace_file}  (splitserve traces)", flush=True)
        if stack.settings.core_share_board:
            print(
                "cores: the workers divide this host's cores among those busy (SPLITSERVE_CORE_SHARE=off: "
                "each uses all)",
                flush=True,
            )
        if args.demo:
            _demo(stack.router_address, tls_ca)
        if args.exit_after_demo:
            return 0
        print("serving; Ctrl-C to drain and stop (a process that exits is started again)", flush=True)
        stack.supervise(stop)
        print("\ndraining and stopping ...", flush=True)
        return 0
    finally:
        stack.stop()
        try:
            os.unlink(_state_file())
        except FileNotFoundError:
            pass
        left = stack.shm_segments()
        print(f"stopped; shared-memory segments left: {len(left)}", flush=True)


def _model_name(stack) -> str:
    """The model's name as the router's /v1/models says it."""
    import json
    import urllib.request

    from splitserve.engine.loader import served_model_name

    try:
        with urllib.request.urlopen(f"http://{stack.router_http_address}/v1/models", timeout=5) as f:
            return json.load(f)["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError):
        return served_model_name(stack.settings.served_model_name, stack.settings.model or "the default")


def _demo(address: str, tls_ca: str | None = None) -> None:
    from splitserve.client import Client

    question = "Give me three short tips for writing clear Python code."
    print(f"\ndemo request (chat, streamed): {question}\n", flush=True)
    with Client(address, tls_ca=tls_ca) as c:
        for chunk in c.generate_stream(messages=[{"role": "user", "content": question}], max_tokens=96):
            print(chunk.text, end="", flush=True)
            if chunk.finish_reason:
                t = chunk.timings
                cached = f" ({chunk.usage.cached_tokens} cached)" if chunk.usage.cached_tokens else ""
                print(
                    f"\n\n[finish: {chunk.finish_reason}; {chunk.usage.prompt_tokens} prompt{cached} + "
                    f"{chunk.usage.completion_tokens} completion tokens; TTFT {t.ttft_ms:.0f} ms (admission "
                    f"{t.admission_ms:.1f}, queue {t.queue_ms:.1f}, prefill {t.prefill_ms:.0f}, first token "
                    f"{t.first_token_ms:.1f}; KV transfer alongside {t.kv_transfer_ms:.1f}); "
                    f"total {t.e2e_ms:.0f} ms]\n",
                    flush=True,
                )


def _logit_bias(items: list[str] | None) -> dict[int, float] | None:
    """--logit-bias TOKEN_ID=BIAS, repeated -> {token id: bias}."""
    out = {}
    for item in items or ():
        token, _, bias = item.partition("=")  # without "=", bias is "" and float() refuses it
        try:
            out[int(token)] = float(bias)
        except ValueError:
            raise SystemExit(f"splitserve: error: --logit-bias takes TOKEN_ID=BIAS, got {item!r}") from None
    return out or None


def _print_logprobs(what: str, logprobs) -> None:
    """TokenLogprob messages, one a line, to stderr, then their sum (the text's log probability)."""
    import json

    print(
        f"[{what}: token id, its text (JSON), log probability, rank; the most likely at its position]", file=sys.stderr
    )
    for lp in logprobs:
        top = " ".join(f"{t.token_id}:{t.logprob:.3f}" for t in lp.top_logprobs)
        print(f"{lp.token_id}\t{json.dumps(lp.token)}\t{lp.logprob:.4f}\t{lp.rank}\t{top}", file=sys.stderr)
    print(f"[sum: {sum(lp.logprob for lp in logprobs):.4f}]", file=sys.stderr)


def _structured_output(args) -> dict | None:
    """--json-schema, --json-object, --regex, --choice or --lark -> Client's structured_output."""
    compact = {"disable_any_whitespace": True} if args.compact_json else {}
    for kind in ("json_schema", "regex", "lark"):
        value = getattr(args, kind)
        if value is not None:
            if value.startswith("@") and kind != "regex":
                try:
                    with open(value[1:], encoding="utf-8") as f:
                        value = f.read()
                except OSError as e:
                    raise SystemExit(f"splitserve: error: --{kind.replace('_', '-')}: {e}") from None
            return {kind: value, **compact}
    if args.json_object:
        return {"json_object": True, **compact}
    return {"choice": args.choice} if args.choice else None


def _print_samples(client, prompt, timeout, resumes, kw) -> int:
    """n > 1: each sample's text, after a line naming it (on stderr), once all have finished.
    resumes: streamed, going on after its router is lost (generate_stream's resumes)."""
    import grpc

    try:
        if resumes:
            texts, ends = {}, {}
            for chunk in client.generate_stream(prompt, timeout=timeout, resumes=resumes, **kw):
                texts[chunk.index] = texts.get(chunk.index, "") + chunk.text
                if chunk.finish_reason:
                    ends[chunk.index] = (chunk.finish_reason, chunk.usage.completion_tokens)
            choices = [(i, *ends[i], texts.get(i, "")) for i in sorted(ends)]
        else:
            choices = [
                (c.index, c.finish_reason, c.usage.completion_tokens, c.text)
                for c in client.generate(prompt, timeout=timeout, **kw).choices
            ]
    except grpc.RpcError as e:
        print(f"splitserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    for index, finish_reason, tokens, text in choices:
        print(f"[sample {index}: {finish_reason}, {tokens} tokens]", file=sys.stderr)
        print(text, flush=True)
    return 0


def _router_address(args) -> str | None:
    address = args.address or (_read_state() or {}).get("router")
    if not address:
        print("splitserve: error: no --address and no running stack (start one with: splitserve up)", file=sys.stderr)
    return address


def _router_tls_ca(args) -> str | None:
    """--tls-ca, or the running stack's CA when its router is the one called (up --tls)."""
    if args.tls_ca is not None:
        return args.tls_ca
    return None if args.address else (_read_state() or {}).get("tls_ca")


def _generate(args) -> int:
    import grpc

    from splitserve.client import Client

    if not (address := _router_address(args)):
        return 2
    kw = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop or None,
        include_stop_str_in_output=args.include_stop,
        truncate_prompt_tokens=args.truncate_prompt_tokens,
        skip_special_tokens=False if args.keep_special_tokens else None,
        n=args.n,
        priority=args.priority,
        request_id=args.request_id,
        cache_salt=args.cache_salt,
        logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        min_p=args.min_p,
        logit_bias=_logit_bias(args.logit_bias),
        structured_output=_structured_output(args),
    )
    if args.chat:
        kw["messages"] = [{"role": "user", "content": args.prompt}]
        prompt = None
    else:
        prompt = args.prompt
    with Client(address, balance=args.resumes > 0, tls_ca=_router_tls_ca(args), token=args.token) as c:
        if args.n is not None and args.n > 1:
            return _print_samples(c, prompt, args.timeout, args.resumes, kw)
        try:
            logprobs = []
            for chunk in c.generate_stream(prompt, timeout=args.timeout, resumes=args.resumes, **kw):
                if args.prompt_logprobs is not None and chunk.prompt_logprobs:
                    _print_logprobs("the prompt's tokens after the first", chunk.prompt_logprobs)
                print(chunk.text, end="", flush=True)
                logprobs.extend(chunk.logprobs)
                if chunk.finish_reason and logprobs:
                    print(file=sys.stderr)
                    _print_logprobs("the output's tokens", logprobs)
                if chunk.finish_reason:
                    when = (
                        "replayed: the recorded result of this finished request_id"
                        if chunk.replayed
                        else f"TTFT {chunk.timings.ttft_ms:.0f} ms"
                    )
                    cached = f", {chunk.usage.cached_tokens} prompt tokens cached" if chunk.usage.cached_tokens else ""
                    print(
                        f"\n[{chunk.finish_reason}, {chunk.usage.completion_tokens} tokens{cached}, {when}]",
                        file=sys.stderr,
                    )
        except grpc.RpcError as e:
            print(f"\nsplitserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


def _traces(args) -> int:

    from splitserve.observability import traceview

    path = args.file
    if not path:
        state = _read_state() or _read_state("last-stack.json")
        path = (state or {}).get("trace_file", "")
    if not path or not os.path.isfile(path):
        print(
            "splitserve: error: no span file (pass --file, or start a stack with splitserve up; with an OTLP "
            "endpoint set, traces go to your collector instead)",
            file=sys.stderr,
        )
        return 2
    spans = traceview.load_spans(path)
    traces = traceview.find(spans, request_id=args.request_id, last=args.last)
    if not traces:
        what = f"request {args.request_id!r}" if args.request_id else "any request"
        print(f"splitserve: error: no trace for {what} in {path}", file=sys.stderr)
        return 1
    batches = traceview.linked_batches(spans)
    print("\n\n".join(traceview.render(t, batches) for t in traces))
    return 0


def _request(args) -> int:
    import time

    import grpc

    from splitserve.client import Client

    if not (address := _router_address(args)):
        return 2
    with Client(address, tls_ca=_router_tls_ca(args), token=args.token) as c:
        try:
            info = c.get_request(args.request_id, timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"splitserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print(describe_request(info, time.time()))
    return 0


def describe_request(info, now: float) -> str:
    """A request's record (GetRequest's RequestInfo) for a terminal: its state, where it ran, its
    tokens and its timestamps as a timeline from its arrival; one not ended, with how long it has
    been since the last of them (now: unix time)."""
    from splitserve.service.redis_state import FINAL_STATES

    state = info.state + (f": {info.finish_reason}" if info.finish_reason else "")
    lines = [
        f"request   {info.request_id}"
        + (f"  (attempt {info.attempts}: the fields are its latest's)" if info.attempts > 1 else ""),
        f"state     {state}",
    ]
    where = [f"{role} {w}" for role, w in (("prefill", info.prefill_worker), ("decode", info.decode_worker)) if w]
    if where:
        lines.append(f"workers   {', '.join(where)}" + (f"  (resumed {info.resumes}x)" if info.resumes else ""))
    cached = f" ({info.cached_tokens} cached)" if info.cached_tokens else ""
    lines.append(
        f"tokens    {info.prompt_tokens} prompt{cached}, {info.completion_tokens} completion"
        + ("" if info.state in FINAL_STATES else " so far (its router's count, every half heartbeat)")
    )
    if info.kv_transport:
        lines.append(f"kv        {info.kv_bytes} bytes over {info.kv_transport}")
    if info.error:
        lines.append(f"error     {info.error}")
    stamps = sorted(info.timestamps.items(), key=lambda kv: kv[1])
    if stamps:
        t0 = stamps[0][1]
        lines.append("timeline  ms after the first")
        lines += [f"{(t - t0) * 1000:12.1f}  {name}" for name, t in stamps]
        if info.state not in FINAL_STATES:
            last, t = stamps[-1]
            lines.append(f"{(now - t0) * 1000:12.1f}  now: {info.state}, {(now - t) * 1000:.1f} ms after {last}")
    return "\n".join(lines)


def _status(args) -> int:
    import time
    from types import SimpleNamespace

    import redis

    from splitserve.service.redis_state import (
        QUEUE_FIELDS,
        REDIS_TLS_ARGS,
        Keys,
        WorkerInfo,
        connect,
        queue_counts,
        tls_files,
    )
    from splitserve.service.settings import env_name

    state = _read_state() or {}
    url = args.redis_url or state.get("redis_url") or os.environ.get("REDIS_URL", "")
    if not url:
        print("splitserve: error: no --redis-url, no REDIS_URL and no running stack", file=sys.stderr)
        return 2
    if not url.startswith(("redis://", "rediss://", "unix://")):  # one line, not redis-py's traceback
        where = "--redis-url" if args.redis_url else "the running stack's" if state.get("redis_url") else "REDIS_URL"
        print(
            f"splitserve: error: {where} {url!r} is not a Redis URL (redis://HOST:PORT, rediss://… or unix://PATH)",
            file=sys.stderr,
        )
        return 2
    keys = Keys(args.prefix or state.get("redis_prefix") or "splitserve")
    # the Redis TLS files from the environment the stack's processes read
    files = SimpleNamespace(**{f: os.environ.get(env_name(f), "") for f in REDIS_TLS_ARGS})
    r = connect(url, os.environ.get("SPLITSERVE_REDIS_CLUSTER") or "auto", **tls_files(files))
    try:
        q, t = queue_counts(r.hmget(keys.admission, *QUEUE_FIELDS))
        by_class = {c: r.xlen(k) for c, k in keys.by_class.items()}
        # normal priority, queued for one prefill worker (prefill affinity)
        by_class["sent to a prefill worker"] = sum(
            r.xlen(keys.stream_to(m.decode())) for m in r.smembers(keys.directed)
        )
        workers, unreadable = [], []
        for k in r.scan_iter(match=keys.worker_pattern("*")):
            try:
                if m := r.hgetall(k):
                    workers.append(WorkerInfo.from_mapping(m))
            except (ValueError, redis.ResponseError) as e:  # not an entry a worker writes (another release's?)
                unreadable.append(f"{k.decode(errors='replace')}: {e}")
        sec, usec = r.time()  # router leases are in Redis's clock
        routers = [
            (rid.decode(), lease - (sec + usec / 1e6), r.scard(keys.router_requests(rid.decode())))
            for rid, lease in r.zrange(keys.routers, 0, -1, withscores=True)
        ]
    except redis.RedisError as e:
        print(f"splitserve: error: redis at {url}: {e}", file=sys.stderr)
        return 1
    if state.get("router"):
        print(f"router        {', '.join(state.get('routers') or [state['router']])}")
    print(
        f"queue         {q} requests, {t} prompt tokens admitted and waiting for prefill "
        f"(stream entries incl. in-flight: " + ", ".join(f"{c} {n}" for c, n in by_class.items()) + ")"
    )
    print(
        f"routers       {len(routers)} in Redis: "
        + (
            ", ".join(
                f"{rid} ({held} requests held, lease {left:.1f}s left)"
                if left > 0
                else f"{rid} (lease ran out {-left:.1f}s ago)"
                for rid, left, held in routers
            )
            or "none"
        )
    )
    print(
        f"workers       {sum(w.role == 'prefill' for w in workers)} prefill, "
        f"{sum(w.role == 'decode' for w in workers)} decode"
    )
    hdr = (
        f"  {'role':8} {'worker':28} {'address':22} {'running':>7} {'waiting':>7} {'pending':>7} {'open':>5} "
        f"{'free KV tok':>11} {'seen':>6}  metrics"
    )
    print(hdr)
    now = time.time()
    for w in sorted(workers, key=lambda w: (w.role, w.worker_id)):
        print(
            f"  {w.role:8} {w.worker_id[:28]:28} {w.address:22} {w.running:7d} {w.waiting:7d} {w.pending:7d} "
            f"{w.opened - w.closed:5d} {w.free_kv_tokens:11d} {now - w.updated:5.1f}s  {w.metrics}"
        )
    for line in unreadable:
        print(f"  left out, not a registry entry: {line}")
    return 0


def _token(args) -> int:
    from splitserve.service.tenants import add_token

    quotas = {
        "max_queued_requests": args.max_queued_requests,
        "max_queued_tokens": args.max_queued_tokens,
        "best_priority": args.best_priority,
    }
    rpcs = [r.strip() for r in args.rpcs.split(",")] if args.rpcs else None
    try:
        token = add_token(args.file, args.tenant, quotas, rpcs)
    except (ValueError, OSError) as e:
        print(f"splitserve token: error: {e}", file=sys.stderr)
        return 2
    print(token)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check-model", help="load a model (converting and caching it) and describe it")
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.set_defaults(func=_check_model)

    p = sub.add_parser("up", help="start Redis, the workers and the router; Ctrl-C drains and stops")
    p.add_argument("--prefill", type=_at_least(0), default=1, help="prefill workers (default 1)")
    p.add_argument("--decode", type=_at_least(1), default=1, help="decode workers (default 1)")
    p.add_argument(
        "--routers",
        type=_at_least(1),
        default=1,
        help="routers (default 1); they share the queue bounds through Redis, and any of them aborts any request",
    )
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the model's own)")
    p.add_argument("--log-format", choices=LOG_FORMATS, default=None, help="every process's logs: text or json lines")
    p.add_argument("--host", default=None, help="the routers' bind address (default 127.0.0.1)")
    p.add_argument(
        "--port", type=_port, default=50051, help="the first router's gRPC port (default 50051; 0: a free one)"
    )
    p.add_argument(
        "--http-port", type=_port, default=8000, help="its OpenAI-compatible HTTP port (default 8000; 0: off)"
    )
    p.add_argument("--policy", default=None, choices=["continuous", "dynamic", "static"])
    p.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help="the engines' dtype (default auto: the checkpoint's bf16 or fp16 on CUDA, float32 on the CPU)",
    )
    p.add_argument(
        "--weights",
        default=None,
        choices=WEIGHTS,
        help="what the CPU's small-GEMM kernel reads: the checkpoint's own blocks (native, the default) or fp32",
    )
    p.add_argument(
        "--colocated",
        action="store_true",
        help="no prefill workers: decode workers prefill prompts themselves (chunked prefill)",
    )
    p.add_argument(
        "--tls", action="store_true", help="every hop over TLS (mTLS inside), with a throwaway CA made for this stack"
    )
    p.add_argument("--demo", action="store_true", help="send one streamed demo request once up")
    p.add_argument("--exit-after-demo", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=_up)

    p = sub.add_parser("generate", help="stream a completion to the terminal")
    p.add_argument("prompt")
    p.add_argument("--address", default="", help="router address (default: the stack started by splitserve up)")
    p.add_argument("--tls-ca", default=None, help="PEM CA file of a router serving TLS (default: the stack's)")
    p.add_argument(
        "--token",
        default=os.environ.get("SPLITSERVE_TOKEN"),
        help="a tenant's bearer token (default: $SPLITSERVE_TOKEN)",
    )
    p.add_argument(
        "--resumes",
        type=_at_least(0),
        default=0,
        metavar="N",
        help="go on after the router is lost mid-stream, at most N times: the request is sent again with "
        "the tokens received (resume_from), to another router when --address names several "
        "(ipv4:HOST:PORT,HOST:PORT), calls then balanced over them",
    )
    p.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append")
    p.add_argument("--include-stop", action="store_true", help="keep the stop string that ended the text at its end")
    p.add_argument(
        "--truncate-prompt-tokens", type=int, default=None, metavar="N", help="keep only the prompt's last N tokens"
    )
    p.add_argument("--keep-special-tokens", action="store_true", help="special tokens' text in the output text")
    p.add_argument("-n", "--n", type=int, default=None, help="samples of the prompt (1-16), printed one after another")
    p.add_argument("--presence-penalty", type=float, default=None, help="-2 to 2: against tokens already in the output")
    p.add_argument("--frequency-penalty", type=float, default=None, help="-2 to 2: the same, once per time there")
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="> 0 (1 = off): divides the logits of tokens in the prompt or output",
    )
    p.add_argument(
        "--min-p",
        type=float,
        default=None,
        help="0-1: draw only tokens at least this times as likely as the most likely",
    )
    p.add_argument(
        "--logit-bias",
        action="append",
        metavar="TOKEN_ID=BIAS",
        help="add BIAS (-100 to 100) to a token's logit; repeatable",
    )
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument(
        "--json-schema", metavar="SCHEMA", help="hold the output to this JSON Schema (JSON text, or @FILE)"
    )
    fmt.add_argument("--json-object", action="store_true", help="hold the output to a JSON object")
    p.add_argument(
        "--compact-json",
        action="store_true",
        help="with --json-schema or --json-object: no whitespace between JSON's tokens",
    )
    fmt.add_argument("--regex", help="hold the output to this regular expression")
    fmt.add_argument("--choice", action="append", help="the output is one of these strings; repeatable")
    fmt.add_argument("--lark", metavar="GRAMMAR", help="hold the output to this Lark grammar (text, or @FILE)")
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="print each token's log probability, its rank and the K most likely (0-20)",
    )
    p.add_argument(
        "--prompt-logprobs",
        type=int,
        default=None,
        metavar="K",
        help="the same for each prompt token after the first, given the tokens before it",
    )
    p.add_argument("--priority", type=int, default=0, help="lower is served first: < 0 high, 0 normal, > 0 low")
    p.add_argument("--request-id", default="", help="client-chosen id (for splitserve traces, GetRequest, Abort)")
    p.add_argument("--cache-salt", default="", help="share cached prompt prefixes only with requests of this salt")
    p.add_argument("--timeout", type=_seconds, default=None, help="deadline in seconds")
    p.set_defaults(func=_generate)

    from splitserve.bench.cli import add_parser as add_bench

    add_bench(sub)

    p = sub.add_parser("traces", help="print a request's trace from the local span file as a timeline")
    p.add_argument("request_id", nargs="?", default=None, help="request id (default: the last --last requests)")
    p.add_argument("--last", type=_at_least(1), default=1, help="how many of the latest requests (default 1)")
    p.add_argument(
        "--file",
        default="",
        help="OTLP-JSON span file, read after its rotated FILE.1 (default: the running or last stack's)",
    )
    p.set_defaults(func=_traces)

    p = sub.add_parser(
        "request", help="where a request is or was: its state, workers, tokens and timestamps (GetRequest)"
    )
    p.add_argument("request_id")
    p.add_argument("--address", default=None, help="router address (default: the stack started by splitserve up)")
    p.add_argument("--tls-ca", default=None, help="PEM CA file of a router serving TLS (default: the stack's)")
    p.add_argument(
        "--token",
        default=os.environ.get("SPLITSERVE_TOKEN"),
        help="a tenant's bearer token (default: $SPLITSERVE_TOKEN)",
    )
    p.add_argument("--timeout", type=_seconds, default=10.0, help="seconds")
    p.set_defaults(func=_request)

    p = sub.add_parser(
        "token", help="make a bearer token for a tenant, add its SHA-256 to the tokens file, print the token"
    )
    p.add_argument("tenant")
    p.add_argument("--file", required=True, help="the tokens file (SPLITSERVE_AUTH_TOKENS_FILE); made if missing")
    p.add_argument("--rpcs", default=None, help="a new tenant's RPCs, comma-separated (default: every public RPC)")
    p.add_argument("--max-queued-requests", type=_at_least(0), default=0, help="a new tenant's quota (0: none)")
    p.add_argument("--max-queued-tokens", type=_at_least(0), default=0, help="a new tenant's quota (0: none)")
    p.add_argument(
        "--best-priority",
        type=int,
        default=0,
        help="the most urgent priority a new tenant may ask for (lower is sooner; default 0, the normal class)",
    )
    p.set_defaults(func=_token)

    p = sub.add_parser("status", help="queue depth, workers and their load, from Redis")
    p.add_argument("--redis-url", default="", help="default: the running stack's, or REDIS_URL")
    p.add_argument("--prefix", default="", help="Redis key prefix (default: the stack's, or splitserve)")
    p.set_defaults(func=_status)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log_format = getattr(args, "log_format", None) or os.environ.get("SPLITSERVE_LOG_FORMAT", "text")
    setup_logging("splitserve", log_format if log_format in LOG_FORMATS else "text")  # Settings names a bad one
    try:
        return args.func(args)
    except EngineError as e:
        print(f"splitserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
