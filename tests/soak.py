"""Soak: mixed traffic through a real stack (2 routers, 2 prefill and 2 decode workers, the real
model) for a while, with processes killed, stopped and restarted meanwhile; then every leak check
of the tests. `make soak` runs it; it exits 1 on any problem it finds, after printing them all.

Each client thread loops over requests that mix, seeded:
  - streams with `resumes=2` whose tokens are checked: exactly max_tokens per sample, n up to 4;
  - cancels mid-stream, deadlines of 0.05-1 s, an Abort from another thread;
  - log probabilities, priorities, prompts of 3-300 words: half of them random, half from a pool
    (most of whose prompts share a 160-word system prompt: prefix caching, prefix affinity);
  - chats of 3 turns, each turn's prompt the last one's with its answer and a new question (the
    decode worker holds part of its KV: partial handoffs);
  - penalties (presence, frequency, repetition), and prompt log probabilities, exactly one per
    prompt token after the first, however often the stream resumed;
  - structured outputs (a choice, a regex, a JSON Schema) and stop strings, whose text is checked:
    a whole stream that ended "stop" matches its format, or ends where a stop string began (cut
    from its text, which holds none of them); one that ended "length" has max_tokens tokens.
With --invariant (SPLITSERVE_BATCH_INVARIANT: a request's tokens the same whatever shares its
steps), every stream's tokens are also checked against the others of its prompt and seed: what
one computed, resumed, preempted or from a cached prefix, another computed otherwise.
Every 12 s (unless --no-chaos), the next of: kill -9 of a decode worker, a prefill worker or a
router (restarted on its port); SIGTERM of a router or a prefill worker (restarted); SIGSTOP of a
decode worker for 3 s (not long enough to be taken for lost), of a decode or a prefill worker for
HANG_S (a decode worker is taken for lost: its streams resume elsewhere, and it goes on after; a
prefill worker's jobs are claimed and prefilled by the other, handed off already or not), or of
Redis for 2 s.

A problem is: a chaos step that failed (a process sent SIGTERM that did not exit within 30 s); a
stream with the wrong number of tokens or the wrong text (or, with --invariant, tokens that differ from
another stream's of the same prompt and seed); INTERNAL, UNKNOWN or INVALID_ARGUMENT (it sends no
bad request: one is the client library's own re-send); an exception in a client; any
UNAVAILABLE without chaos; after the run, KV held by a decode worker or arena, queue counts not
zero, a key without a TTL, a departed worker's stream left, a shared-memory segment left, an ERROR
line or a traceback in a process's log; and without chaos, a process whose memory grew (RSS, the
median of its samples in the run's last quarter against its second quarter's) by more than
RSS_GROWTH: what requests leave behind. What clients saw under chaos is printed by status and
message: each is an honest status, but a count to watch.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import random
import re
import signal
import statistics
import sys
import threading
import time
import traceback

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from service_helpers import departed_streams, keys_without_ttl, kv_idle, wait_for, workers  # noqa: E402

from splitserve.client import Client  # noqa: E402
from splitserve.service.redis_state import LOCAL_FIELD, QUEUE_FIELDS, queue_counts  # noqa: E402
from splitserve.service.settings import Settings  # noqa: E402
from splitserve.stack import Stack  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while seven lighthouse keepers count waves".split()
CHAOS = [
    "kill decode-1",
    "kill prefill-0",
    "term router-1",
    "stop decode-0",
    "stop redis",
    "kill decode-0",
    "term prefill-1",
    "hang decode-1",
    "kill router",
    "hang prefill-0",
]
KEEPALIVE_S, CLAIM_IDLE_MS = 2.0, 1500
HANG_S = 3 * max(KEEPALIVE_S, CLAIM_IDLE_MS / 1000)
EXPECTED = {"DEADLINE_EXCEEDED", "CANCELLED", "RESOURCE_EXHAUSTED"}  # besides UNAVAILABLE under chaos
# The soak sends no bad request: INVALID_ARGUMENT is one the client library made (a resume's re-send)
PROBLEMS = {"INTERNAL", "UNKNOWN", "INVALID_ARGUMENT"}
# Formats a stream may be held to, and stop strings it may end at: checked against its text
FORMATS = [
    {"choice": ["red", "green", "blue", "a shade of purple that nobody has named yet"]},
    {"regex": r"[a-z]+( [a-z]+){3,12}\."},
    {
        "json_schema": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 30}, "count": {"type": "integer"}},
            "required": ["name", "count"],
            "additionalProperties": False,
        }
    },
]
STOPS = [[" the"], [".", "!"], ["ing", "ed "]]
RSS_EVERY_S = 5.0
RSS_GROWTH = (64 << 20, 0.10)  # bytes, and a fraction of the process's size: the more of the two
PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.outcomes = collections.Counter()
        self.messages = collections.Counter()
        self.problems: list[str] = []
        self.invariant = False
        self.seen: dict[tuple, tuple[str, list[int]]] = {}  # check's key -> the longest stream
        self.checked = 0
        self.prompt_tokens = collections.Counter()  # of whole streams: "prompt" and "cached" (prefix caches)
        # whole streams' samples with a format or stop strings (by how they ended), or penalties;
        # streams with prompt log probabilities
        self.held = collections.Counter()

    def check(self, rid: str, prompt: str, kw: dict, index: int, tokens: list[int]) -> None:
        """With batch invariance, a sample is a function of its prompt, temperature and seed (sample i
        is seeded seed + i): with ignore_eos, a stream's tokens start with a shorter one's."""
        if not self.invariant:
            return
        temperature = kw.get("temperature", 0.0)
        key = (
            prompt,
            temperature,
            kw.get("seed", 0) + index if temperature else None,
            json.dumps(kw.get("structured_output"), sort_keys=True),
            tuple(kw.get("stop", ())),
            tuple(kw.get(k) for k in PENALTIES),
        )
        with self.lock:
            self.checked += 1
            other, seen = self.seen.get(key, ("", []))
            k = min(len(seen), len(tokens))
            if seen[:k] != tokens[:k]:
                at = next(j for j in range(k) if seen[j] != tokens[j])
                self.problems.append(
                    f"{rid} sample {index}: token {at} is {tokens[at]}, {other}'s was {seen[at]} "
                    f"(the same prompt and seed; {len(prompt.split())} words)"
                )
            elif len(tokens) > len(seen):
                self.seen[key] = (rid, tokens)

    def add(self, outcome: str, message: str = "", problem: str = ""):
        with self.lock:
            self.outcomes[outcome] += 1
            if message:
                self.messages[f"{outcome}: {message[:240]}"] += 1
            if problem:
                self.problems.append(problem)


def abort(c: Client, rid: str, tally: Tally) -> None:
    """An Abort from another thread. NOT_FOUND: it came before its request (which is then refused
    CANCELLED), or after its end."""
    try:
        c.abort(rid)
    except grpc.RpcError as e:
        code = e.code().name
        problem = f"Abort of {rid}: {code} {e.details()}" if code in ("INTERNAL", "UNKNOWN") else ""
        tally.add(f"(an Abort answered {code})", "", problem)


def prompt_pool(seed: int) -> list[str]:
    """8 prompts that share a system prompt of 160 words, and 4 that do not; the same for every client."""
    rng = random.Random(seed)
    system = " ".join(rng.choice(WORDS) for _ in range(160))
    questions = [" ".join(rng.choice(WORDS) for _ in range(rng.choice([3, 12, 40]))) for _ in range(12)]
    return [f"{system} {q}" for q in questions[:8]] + questions[8:]


def streamed(c: Client, rid: str, prompt: str, kw: dict, tally: Tally) -> str | None:
    """A stream with resumes=2, its tokens counted (and with --invariant, checked); its text if whole."""
    n = kw.get("n", 1)
    tokens, finish, text = collections.defaultdict(list), {}, collections.defaultdict(str)
    scored, prompt_tokens = 0, 0  # prompt log probabilities that came, and the prompt's tokens
    for m in c.generate_stream(prompt, timeout=90, resumes=2, **kw):
        for ch in m.choices or [m]:
            tokens[ch.index] += ch.token_ids
            text[ch.index] += ch.text
            scored += len(ch.prompt_logprobs)
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
                if ch.index == 0:  # (each sample's end carries the request's usage)
                    prompt_tokens = ch.usage.prompt_tokens
                    with tally.lock:
                        tally.prompt_tokens.update(prompt=ch.usage.prompt_tokens, cached=ch.usage.cached_tokens)
    if kw.get("prompt_logprobs") is not None and scored != prompt_tokens - 1:
        tally.add("WRONG", problem=f"{rid}: {scored} prompt log probabilities for a {prompt_tokens}-token prompt")
        return None
    wrong = [f"sample {j}: {why}" for j in range(n) if (why := wrong_end(kw, tokens[j], finish.get(j), text[j]))]
    if wrong:
        tally.add("WRONG", problem=f"{rid}: " + "; ".join(wrong)[:600])
        return None
    for j in range(n):
        tally.check(rid, prompt, kw, j, list(tokens[j]))
    with tally.lock:
        if kw.get("structured_output") or kw.get("stop"):
            kind = next(iter(kw["structured_output"])) if kw.get("structured_output") else "stop strings"
            tally.held.update(f"{kind}, {finish[j]}" for j in range(n))
        if kw.get("prompt_logprobs") is not None:
            tally.held["prompt log probabilities"] += 1
        if kw.get("presence_penalty") is not None:
            tally.held["penalties"] += n
    tally.add("OK")
    return text[0]


def wrong_end(kw: dict, tokens: list[int], finish: str | None, text: str) -> str:
    """What is wrong with a whole stream's sample (its tokens, how it finished, its text): "" if
    nothing. It runs to max_tokens unless it has a format or stop strings, and then its text must
    be theirs."""
    want, fmt, stops = kw["max_tokens"], kw.get("structured_output"), kw.get("stop", [])
    if finish == "length":
        if len(tokens) != want:
            return f"{len(tokens)} tokens, finished length; want {want}"
        if any(x in text for x in stops):
            return f"a stop string in its text {text[-200:]!r}"
        if fmt and "choice" in fmt and not any(c.startswith(text) for c in fmt["choice"]):
            return f"text {text!r} is not the start of a choice"
        return ""
    if finish != "stop" or not (fmt or stops) or not 0 < len(tokens) <= want:
        return f"{len(tokens)} tokens, finished {finish}; want {want}" + (" or a stop" if fmt or stops else "")
    if stops:
        return f"a stop string in its text {text[-200:]!r}" if any(x in text for x in stops) else ""
    if "choice" in fmt:
        return "" if text in fmt["choice"] else f"text {text!r} is not a choice"
    if "regex" in fmt:
        return "" if re.fullmatch(fmt["regex"], text) else f"text {text!r} does not match {fmt['regex']!r}"
    try:
        doc = json.loads(text)
    except ValueError as e:
        return f"text {text[-200:]!r} is not JSON: {e}"
    ok = (
        isinstance(doc, dict)
        and sorted(doc) == ["count", "name"]
        and isinstance(doc["name"], str)
        and isinstance(doc["count"], int)
        and len(doc["name"]) <= 30
    )
    return "" if ok else f"JSON {doc!r} does not follow its schema"


def client_loop(i: int, target: str, seed: int, stop_at: float, tally: Tally, samples: bool = True) -> None:
    """One client's requests; `samples` false (a padded policy: n > 1 needs continuous batching)
    sends n = 1 where it would send more, with the same draws."""
    rng = random.Random(seed * 100 + i)
    pool = prompt_pool(seed)
    c = Client(target, balance=True)
    k = 0
    while time.time() < stop_at:
        k += 1
        rid = f"soak{i}-{k}"
        if rng.random() < 0.5:
            prompt = rng.choice(pool)
        else:
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.choice([3, 20, 80, 300])))
        kw = dict(
            max_tokens=rng.choice([1, 4, 16, 48]), ignore_eos=True, request_id=rid, priority=rng.choice([-1, 0, 0, 1])
        )
        if rng.random() < 0.15:
            kw.update(n=rng.choice([2, 4]) if samples else 1, temperature=1.0, seed=rng.randrange(100))
        if rng.random() < 0.1:
            kw.update(logprobs=2)
        if rng.random() < 0.1:  # (in the key of --invariant's check)
            kw.update(zip(PENALTIES, rng.choice([(0.5, 0.0, 1.0), (0.0, 0.4, 1.0), (0.0, 0.0, 1.3), (0.3, 0.2, 1.1)])))
        if samples and rng.random() < 0.05:  # (padded policies refuse them)
            kw.update(prompt_logprobs=rng.choice([0, 1]))
        held = rng.random()
        if held < 0.1:
            kw.update(structured_output=rng.choice(FORMATS))
        elif held < 0.2:
            kw.update(stop=rng.choice(STOPS))
        kind = rng.random()
        try:
            if kind < 0.15:  # cancelled mid-stream
                stream = c.generate_stream(prompt, timeout=60, **kw)
                for j, _ in enumerate(stream):
                    if j >= 2:
                        stream.cancel()
                        break
                tally.add("cancelled by its client")
            elif kind < 0.25:  # a tight deadline
                got = c.generate(prompt, timeout=rng.choice([0.05, 0.3, 1.0]), **kw)
                for ch in got.choices or [got]:
                    tally.check(rid, prompt, kw, ch.index, list(ch.token_ids))
                tally.add("OK")
            elif kind < 0.3:  # aborted from another thread
                stream = c.generate_stream(prompt, timeout=60, **kw)
                threading.Timer(rng.random() * 0.5, abort, args=(c, rid, tally)).start()
                got = list(stream)
                tally.add("aborted: " + (got[-1].finish_reason if got else "no message"))
            elif kind < 0.4:  # a chat: each turn's prompt is the last one's, its answer and a question
                kw.pop("n", None)
                kw.update(max_tokens=rng.choice([4, 16, 48]))
                prompt = rng.choice(pool[:8])
                for turn in range(3):
                    kw["request_id"] = f"{rid}-{turn}"
                    answer = streamed(c, kw["request_id"], prompt, kw, tally)
                    if answer is None:
                        break
                    prompt = f"{prompt} {answer} {rng.choice(pool[8:])}"
            else:  # streamed whole, resuming, its tokens counted
                streamed(c, rid, prompt, kw, tally)
        except grpc.RpcError as e:
            code = e.code().name
            problem = f"{rid}: {code} {e.details()}" if code in PROBLEMS else ""
            tally.add(code, "" if code in EXPECTED else e.details() or "", problem)
        except Exception:  # noqa: BLE001
            tally.add("EXCEPTION", problem=f"{rid}: {traceback.format_exc()[-600:]}")


def chaos_loop(stack: Stack, mode: str, stop_at: float, t0: float, every: float, tally: Tally) -> None:
    j = 0
    while time.time() < stop_at - 20:
        time.sleep(every)
        event = CHAOS[j % len(CHAOS)]
        j += 1
        what, name = event.split()
        if mode == "colocated" and name.startswith("prefill"):
            continue
        print(f"{time.time() - t0:6.1f} s  chaos: {event}", flush=True)
        try:
            if name == "redis":
                os.kill(stack.redis_proc.pid, signal.SIGSTOP)
                time.sleep(2)
                os.kill(stack.redis_proc.pid, signal.SIGCONT)
                continue
            p = stack.proc(name)
            if what in ("stop", "hang"):
                os.kill(p.popen.pid, signal.SIGSTOP)
                time.sleep(3 if what == "stop" else HANG_S)
                os.kill(p.popen.pid, signal.SIGCONT)
                continue
            p.popen.send_signal(signal.SIGKILL if what == "kill" else signal.SIGTERM)
            p.popen.wait(timeout=30)
            time.sleep(1)
            stack.restart(name)
        except Exception as e:  # noqa: BLE001 - a process that did not exit on SIGTERM within 30 s, ...
            print("chaos step failed:", traceback.format_exc(), flush=True)
            tally.add(
                "(a chaos step failed)",
                problem=f"chaos: {event} at {time.time() - t0:.1f} s failed: {type(e).__name__}: {str(e)[:300]}",
            )


def rss(pid: int) -> int | None:
    """The resident memory of process ``pid`` in bytes (VmRSS), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def memory_loop(stack: Stack, t0: float, stop_at: float, samples: list[tuple]) -> None:
    """Every RSS_EVERY_S until stop_at: (seconds since t0, name, pid, RSS) of each of the stack's processes
    and Redis."""
    while time.time() < stop_at:
        t = time.time() - t0
        for name, pid in [(p.name, p.popen.pid) for p in list(stack.procs)] + [("redis", stack.redis_proc.pid)]:
            if (m := rss(pid)) is not None:
                samples.append((t, name, pid, m))
        time.sleep(RSS_EVERY_S)


def memory_growth(samples: list[tuple], seconds: float) -> list[tuple[str, int, int]]:
    """(name, before, after) for each process sampled in both the run's second quarter (before: the median
    of those samples, once the first requests have sized its caches) and its last quarter (after), as the
    same process (pid): one restarted in between is not compared."""
    windows: dict[tuple, tuple[list, list]] = {}
    for t, name, pid, m in samples:
        w = windows.setdefault((name, pid), ([], []))
        if seconds / 4 <= t < seconds / 2:
            w[0].append(m)
        elif t >= seconds * 3 / 4:
            w[1].append(m)
    return [
        (name, int(statistics.median(a)), int(statistics.median(b)))
        for (name, _), (a, b) in sorted(windows.items())
        if a and b
    ]


def grown(growth: list[tuple[str, int, int]]) -> list[str]:
    """The processes whose memory grew by more than RSS_GROWTH."""
    most, frac = RSS_GROWTH
    return [
        f"{name}'s memory grew from {a / 2**20:.0f} MB to {b / 2**20:.0f} MB over the run (RSS, medians of its "
        f"second and last quarters; more than {most / 2**20:.0f} MB and {frac:.0%} is a problem)"
        for name, a, b in growth
        if b - a > max(most, frac * a)
    ]


def leaks(stack: Stack) -> list[str]:
    found = []
    try:
        wait_for(lambda: kv_idle(stack), timeout=30, what="every worker's KV and arena empty")
    except AssertionError as e:
        found.append(str(e))
        for role in ("decode", "prefill"):
            for w in workers(stack, role):
                found.append(
                    f"  {role} "
                    + json.dumps(
                        {
                            k: w[k]
                            for k in (
                                "worker_id",
                                "running",
                                "waiting",
                                "pending",
                                "opened",
                                "closed",
                                "free_kv_tokens",
                            )
                            if k in w
                        }
                    )
                )
    r = stack.redis()
    counts = list(queue_counts(r.hmget(stack.keys.admission, *QUEUE_FIELDS)))
    local = int(r.hget(stack.keys.admission, LOCAL_FIELD) or 0)
    if counts != [0, 0] or local:
        found.append(f"the queue's counts are {counts} (requests, tokens), {local} prefilled by decode workers")
    if no_ttl := keys_without_ttl(stack):
        found.append(f"keys without a TTL: {no_ttl}")
    if departed := departed_streams(stack):
        found.append(f"the streams of departed prefill workers: {departed}")
    return found


def log_problems(run_dir: str) -> list[str]:
    found = collections.Counter()
    for path in glob.glob(os.path.join(run_dir, "*.log*")):
        with open(path, errors="replace") as f:
            for line in f:
                if " ERROR " in line or "Traceback" in line:
                    found[f"{os.path.basename(path)}: {line.strip()[:240]}"] += 1
    return [f"{n} x {line}" for line, n in found.most_common(20)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=240)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--mode", choices=("disaggregated", "colocated"), default="disaggregated")
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--chaos-every", type=float, default=12.0, help="seconds between chaos events")
    ap.add_argument("--no-chaos", action="store_true")
    ap.add_argument("--kv-mb", type=int, default=96, help="each decode worker's KV cache (small: preemptions)")
    ap.add_argument(
        "--invariant",
        action="store_true",
        help="batch-invariant engines, and every stream's tokens checked against the others' of its prompt and seed",
    )
    ap.add_argument("--out", help="write the outcomes and problems here, as JSON")
    a = ap.parse_args(argv)

    settings = Settings.from_env(
        kv_cache_bytes=a.kv_mb << 20,
        mode=a.mode,
        prefill_kv_cache_bytes=128 << 20,
        arena_bytes=64 << 20,
        heartbeat_s=0.25,
        drain_s=2.0,
        claim_idle_ms=CLAIM_IDLE_MS,
        keepalive_s=KEEPALIVE_S,
        batch_invariant=a.invariant or None,
    )
    stack = Stack(settings, prefill=0 if a.mode == "colocated" else 2, decode=2, routers=2).start()
    print(f"stack up: routers {stack.router_addresses}, logs in {stack.run_dir}", flush=True)
    tally = Tally()
    tally.invariant = stack.settings.batch_invariant
    problems: list[str] = []
    memory: list[tuple] = []
    growth: list[tuple[str, int, int]] = []
    t0 = time.time()
    stop_at = t0 + a.seconds
    target = "ipv4:" + ",".join(stack.router_addresses)
    try:
        samples = stack.settings.policy == "continuous"
        threads = [
            threading.Thread(target=client_loop, args=(i, target, a.seed, stop_at, tally, samples))
            for i in range(a.clients)
        ]
        if not a.no_chaos:
            threads.append(threading.Thread(target=chaos_loop, args=(stack, a.mode, stop_at, t0, a.chaos_every, tally)))
        threads.append(threading.Thread(target=memory_loop, args=(stack, t0, stop_at, memory)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        problems += tally.problems
        if a.no_chaos and tally.outcomes["UNAVAILABLE"]:
            problems.append(f"{tally.outcomes['UNAVAILABLE']} UNAVAILABLE without chaos")
        time.sleep(3)  # ends and drains in flight
        problems += leaks(stack)
        growth = memory_growth(memory, a.seconds)
        if a.no_chaos:
            problems += grown(growth)
    finally:
        stack.stop()
    if segments := stack.shm_segments():
        problems.append(f"shared-memory segments left: {segments}")
    problems += log_problems(stack.run_dir)

    print(
        f"\n{sum(tally.outcomes.values())} requests in {a.seconds:g} s ({a.mode}, seed {a.seed}, "
        f"{'no chaos' if a.no_chaos else f'chaos every {a.chaos_every:g} s'}):"
    )
    for outcome, n in tally.outcomes.most_common():
        print(f"  {n:6d}  {outcome}")
    if tally.messages:
        print("their messages:")
        for message, n in tally.messages.most_common():
            print(f"  {n:6d}  {message}")
    print(
        f"{tally.prompt_tokens['cached']} of the {tally.prompt_tokens['prompt']} prompt tokens of whole streams "
        "from a prefix cache"
    )
    print(
        "whole streams' samples with a format or stop strings (their text checked), or penalties; streams with "
        "prompt log probabilities (counted): "
        + (", ".join(f"{n} {k}" for k, n in sorted(tally.held.items())) or "none")
    )
    if tally.invariant:
        print(f"{tally.checked} samples' tokens checked against {len(tally.seen)} prompts and seeds'")
    print(
        "memory (RSS, medians of the run's second and last quarters; processes not restarted in between): "
        + (
            ", ".join(f"{name} {before / 2**20:.0f} -> {after / 2**20:.0f} MB" for name, before, after in growth)
            or "none"
        )
    )
    print(f"\n{len(problems)} problem(s)" + (":" if problems else ""))
    for p in problems:
        print("  " + p)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(
                {
                    "settings": vars(a),
                    "outcomes": dict(tally.outcomes),
                    "messages": dict(tally.messages),
                    "memory": [
                        {"process": name, "rss_before": before, "rss_after": after} for name, before, after in growth
                    ],
                    "problems": problems,
                },
                f,
                indent=1,
            )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
