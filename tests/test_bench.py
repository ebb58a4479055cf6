"""splitserve bench: the figures are computed right, and every request sent is accounted for."""

import asyncio
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import threading

import pytest

from splitserve.bench import loadgen
from splitserve.bench.workload import WorkItem
from splitserve.service.settings import Settings
from splitserve.stack import Stack


def _result(i, ttft, e2e, n, ok=True, code="OK"):
    return loadgen.Result(i, ok, code, 10, n if ok else 0, 0.0, ttft if ok else math.nan, e2e if ok else math.nan)


def test_percentiles_match_hand_computed_values():
    # 1..100 ms: linear interpolation between closest ranks (numpy's default).
    vals = [i / 1000 for i in range(1, 101)]
    p = loadgen.pcts(vals)
    assert p["p50"] == pytest.approx(0.0505)
    assert p["p90"] == pytest.approx(0.0901)
    assert p["p99"] == pytest.approx(0.09901)
    assert p["p99.9"] == pytest.approx(0.099901)
    assert p["mean"] == pytest.approx(0.0505)
    # Order does not matter and NaNs (failed requests) are left out.
    shuffled = vals[:]
    random.Random(1).shuffle(shuffled)
    assert loadgen.pcts(shuffled + [math.nan]) == pytest.approx(p)
    assert loadgen.pcts([0.2])["p99.9"] == 0.2


def test_the_median_interval_brackets_the_median_and_narrows_with_more_values():
    from splitserve.bench.workload import median_interval

    assert median_interval([7.0] * 20) == (7.0, 7.0)
    rng = random.Random(3)
    few = [rng.gauss(10, 50) for _ in range(16)]
    many = [rng.gauss(10, 50) for _ in range(400)]
    lo, hi = median_interval(few)
    assert min(few) <= lo < statistics.median(few) < hi <= max(few)
    lo2, hi2 = median_interval(many)
    assert lo2 < statistics.median(many) < hi2 and hi2 - lo2 < (hi - lo) / 2
    assert 10 - 15 < lo2 and hi2 < 10 + 15  # the true median, 10, is within ~3 standard errors (3.1 each)
    assert median_interval(few) == (lo, hi)  # seeded
    assert all(math.isnan(x) for x in median_interval([]))


def test_goodput_counts_requests_meeting_both_limits():
    results = [
        _result(0, ttft=0.1, e2e=1.1, n=11),  # TPOT 0.1: good
        _result(1, ttft=0.3, e2e=1.3, n=11),  # TTFT over
        _result(2, ttft=0.1, e2e=3.1, n=11),  # TPOT 0.3: over
        _result(3, ttft=0.2, e2e=0.2, n=1),  # one token: TPOT not defined, TTFT ok: good
        _result(4, 0, 0, 0, ok=False, code="RESOURCE_EXHAUSTED"),
        _result(5, 0, 0, 0, ok=False, code="RESOURCE_EXHAUSTED"),
        _result(6, 0, 0, 0, ok=False, code="DEADLINE_EXCEEDED"),
    ]
    s = loadgen.summarize(results, wall_s=2.0, ttft_slo_s=0.25, tpot_slo_s=0.2)
    assert s["sent"] == 7 and s["succeeded"] == 4
    assert s["errors"] == {"RESOURCE_EXHAUSTED": 2, "DEADLINE_EXCEEDED": 1}
    assert s["good_requests"] == 2 and s["goodput"] == pytest.approx(1.0)
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["output_throughput"] == pytest.approx(34 / 2)
    assert s["tpot_s"]["p50"] == pytest.approx(0.1)  # TPOTs 0.1, 0.1, 0.3
    no_slo = loadgen.summarize(results, wall_s=2.0)
    assert no_slo["good_requests"] == 4
    assert no_slo["prefilled_locally"] is None  # nobody asked the router


def test_prefilled_locally_counts_the_successes_their_decode_worker_prefilled():
    results = [_result(i, ttft=0.1, e2e=1.0, n=5) for i in range(4)] + [_result(4, 0, 0, 0, ok=False)]
    for r, who in zip(results, ["prefill-a", "", "", None, ""]):
        r.prefill_worker = who
    from splitserve.bench import cli

    s = loadgen.summarize(results, wall_s=1.0)
    assert s["prefilled_locally"] == 2  # the failure is not counted
    assert s["prefill_unknown"] == 1  # the router no longer knew it
    line = cli._local_prefills_line([("static", s)])
    assert line == [
        "prefilled by their decode worker (colocated, or conditional disaggregation): "
        "static 2 of 4 (1 no longer known to the router)"
    ], line


def test_knee_rule():
    pts = [(1, 1.0), (2, 1.1), (4, 1.4), (8, 1.6), (16, 3.0)]
    assert loadgen.find_knee(pts, 1.5) == (4, 8)
    assert loadgen.find_knee(pts, 5.0) == (16, None)
    assert loadgen.find_knee([], 1.5) == (None, None)
    # a concurrency at which no request succeeded (p99 NaN) has degraded; at the lowest, there is no knee
    assert loadgen.find_knee([(1, 1.0), (2, 1.2), (4, math.nan), (8, 1.1)], 1.5) == (2, 4)
    assert loadgen.find_knee([(1, math.nan), (2, math.nan)], 1.5) == (None, 1)  # not: (2, None)


@pytest.fixture(scope="module")
def tiny_stack(tiny_model_dir):
    settings = Settings.from_env(
        model=tiny_model_dir,
        heartbeat_s=0.25,
        drain_s=3.0,
        kv_cache_bytes=64 << 20,
        prefill_kv_cache_bytes=64 << 20,
        arena_bytes=32 << 20,
        max_queue_requests=5,
        admit_fraction=1.0,
        max_num_seqs=4,
    )
    with Stack(settings) as stack:
        yield stack
    assert stack.shm_segments() == []


def _items(n, seed=0):
    rng = random.Random(seed)
    return [
        WorkItem(f"t{i}", "", [rng.randrange(10, 500) for _ in range(rng.randint(4, 40))], rng.randint(2, 12))
        for i in range(n)
    ]


def test_every_request_is_accounted_for_under_overload(tiny_stack):
    """An open loop far beyond a 5-request queue: each request ends once, as a success or its status.
    The prefill worker is stopped for the burst's first 0.3 s (less than its lease), so nothing leaves
    the queue meanwhile and the sixth request on is refused however fast the worker would have been
    (without the stop, one run in the suite had every request admitted)."""
    items = _items(60, seed=1)
    prefill = tiny_stack.proc("prefill-0").popen.pid
    os.kill(prefill, signal.SIGSTOP)
    resume = threading.Timer(0.3, os.kill, (prefill, signal.SIGCONT))
    try:
        resume.start()
        results, wall = asyncio.run(loadgen.run(tiny_stack.router_address, items, loadgen.RunSpec("rate", 2000.0)))
    finally:
        resume.cancel()
        os.kill(prefill, signal.SIGCONT)
    assert sorted(r.index for r in results) == list(range(60))
    s = loadgen.summarize(results, wall)
    assert s["sent"] == 60 and s["succeeded"] + sum(s["errors"].values()) == 60
    assert s["errors"].get("RESOURCE_EXHAUSTED", 0) > 0, s["errors"]
    assert set(s["errors"]) == {"RESOURCE_EXHAUSTED"}
    for r in results:
        if r.ok:  # every success got exactly the tokens it asked for (EOS ignored)
            assert r.output_tokens == items[r.index].max_tokens and 0 < r.ttft_s <= r.e2e_s
            # a few short prompts never reach the local-prefill threshold: a prefill worker did them
            assert r.request_id and r.prefill_worker and r.prefill_worker.startswith("prefill"), r
    assert s["prefilled_locally"] == 0


def test_bench_command_closed_loop_json_and_plots(tiny_stack, tmp_path):
    out = tmp_path / "b"
    cmd = [
        sys.executable,
        "-m",
        "splitserve.cli",
        "bench",
        "--address",
        tiny_stack.router_address,
        "--input-len",
        "4-30",
        "--output-len",
        "2-9",
        "--vocab",
        "500",
        "--requests",
        "10",
        "--warmup",
        "1",
        "--concurrency",
        "1,3",
        "--ttft-slo-ms",
        "5000",
        "--tpot-slo-ms",
        "5000",
        "--high-priority",
        "0.3",
        "--out",
        str(out),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((out / "results.json").read_text())
    assert [p["label"] for p in report["points"]] == ["concurrency=1", "concurrency=3"]
    for p in report["points"]:
        assert p["sent"] == 10 and p["succeeded"] == 10 and p["errors"] == {}
        assert sorted(r["index"] for r in p["requests"]) == list(range(10))
        assert p["good_requests"] == 10
        assert p["output_tokens"] == sum(r["output_tokens"] for r in p["requests"])
        high = [r["index"] for r in p["requests"] if r["priority"] == -1]
        assert len(high) == 3 and {r["priority"] for r in p["requests"]} == {-1, 0}
        classes = p["by_priority"]
        assert set(classes) == {"high", "normal"}
        assert (classes["high"]["sent"], classes["normal"]["sent"]) == (3, 7)
        assert classes["high"]["ttft_s"]["p50"] > 0 and classes["normal"]["e2e_s"]["p99"] > 0
    assert (out / "latency_vs_throughput.png").stat().st_size > 1000
    assert (out / "latency_vs_concurrency.png").stat().st_size > 1000
    assert "concurrency=3" in run.stdout and "TTFT p50" in run.stdout and "priority high" in run.stdout
    assert (
        "prefilled by their decode worker (colocated, or conditional disaggregation): concurrency=1 0 of 10, "
        "concurrency=3 0 of 10" in run.stdout
    )


def test_a_sweep_whose_every_request_fails_writes_its_results_and_says_why_there_are_no_plots(tiny_stack, tmp_path):
    """Every request past its deadline (1 ms): the sweep's results are written, as plain JSON, each
    point's errors counted, no knee, and no plot, with the reason. Guards against: matplotlib's "Data cannot
    be log-scaled" traceback at the first plot, no results.json, and the largest concurrency tried
    printed as the knee."""
    out = tmp_path / "f"
    cmd = [
        sys.executable,
        "-m",
        "splitserve.cli",
        "bench",
        "--address",
        tiny_stack.router_address,
        "--sweep",
        "--max-concurrency",
        "2",
        "--timeout",
        "0.001",
        "--input-len",
        "4-10",
        "--output-len",
        "2-4",
        "--vocab",
        "500",
        "--requests",
        "4",
        "--warmup",
        "0",
        "--no-progress",
        "--out",
        str(out),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr[-2000:]  # none succeeded

    def refuse(constant):  # plain JSON: a percentile of nothing is null (not: NaN, which jq refuses)
        raise AssertionError(f"{constant} in results.json")

    report = json.loads((out / "results.json").read_text(), parse_constant=refuse)
    assert [(p["label"], p["succeeded"], p["errors"]) for p in report["points"]] == [
        ("concurrency=1", 0, {"DEADLINE_EXCEEDED": 4}),
        ("concurrency=2", 0, {"DEADLINE_EXCEEDED": 4}),
    ]
    assert (report["knee"], report["degraded_at"]) == (None, 1)
    assert report["points"][0]["e2e_s"]["p99"] is None and report["points"][0]["ttft_s"]["mean"] is None
    assert list(out.glob("*.png")) == []
    assert "knee: none: no request succeeded at the lowest" in run.stdout
    assert "no plots: no request succeeded" in run.stdout and "Traceback" not in run.stderr


def test_bench_against_an_address_where_nothing_answers_stops_at_once_naming_it(
    tiny_stack, capsys, tmp_path, monkeypatch
):
    """Guards against: every request of every run was sent, failed UNAVAILABLE, and the plots of nothing
    failed. Now: refused before anything is sent or written (exit 2), naming --address."""
    import argparse
    import functools
    import socket

    from splitserve.bench import cli

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setattr(cli, "check_answers", functools.partial(cli.check_answers, wait_s=1.0))
    root = argparse.ArgumentParser()
    cli.add_parser(root.add_subparsers())
    args = root.parse_args(
        [
            "bench",
            "--address",
            f"127.0.0.1:{port}",
            "--out",
            str(tmp_path / "out"),
            "--input-len",
            "4",
            "--output-len",
            "2",
            "--vocab",
            "500",
        ]
    )
    assert cli.main(args) == 2
    assert f"--address 127.0.0.1:{port}: nothing answers there within 1 s" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert cli.check_answers(tiny_stack.router_address, wait_s=5.0) is None  # a router answers


def test_the_stacks_own_measurements_of_a_run_are_the_work_it_was_sent(tiny_model_dir, tmp_path):
    """--compare starts each stack itself, so it reads every process's /metrics after the warm-up
    and after the run: their difference counts exactly the measured requests' work."""
    out = tmp_path / "c"
    env = {
        **os.environ,
        "SPLITSERVE_KV_CACHE_BYTES": str(64 << 20),
        "SPLITSERVE_PREFILL_KV_CACHE_BYTES": str(64 << 20),
        "SPLITSERVE_ARENA_BYTES": str(32 << 20),
        "SPLITSERVE_HEARTBEAT_S": "0.25",
        "SPLITSERVE_DRAIN_S": "3",
    }
    cmd = [
        sys.executable,
        "-m",
        "splitserve.cli",
        "bench",
        "--compare",
        "colocated,disaggregated",
        "--model",
        tiny_model_dir,
        "--input-len",
        "20-60",
        "--output-len",
        "3-9",
        "--vocab",
        "500",
        "--requests",
        "6",
        "--warmup",
        "2",
        "--rate",
        "20",
        "--no-progress",
        "--out",
        str(out),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((out / "results.json").read_text())
    for name, v in report["variants"].items():
        assert v["succeeded"] == 6, (name, v["errors"])
        prompt = sum(r["prompt_tokens"] for r in v["requests"])
        later = sum(r["output_tokens"] - 1 for r in v["requests"])  # each token after the first is one decode
        server = v["server"]
        decode = server["decode-0"]
        assert decode["decode_tokens"] == later
        assert decode["step_s"]["count"] == decode["steps"] > 0 and decode["step_s"]["mean"] > 0
        router = server["router"]  # the parts of TTFT, of each measured request
        assert "steps" not in router and router["admission_s"]["count"] == router["prefill_s"]["count"] == 6
        assert router["prefill_s"]["mean"] > 0
        if name == "colocated":
            assert set(server) == {"decode-0", "router"}
            assert decode["prefill_tokens"] == prompt
        else:
            assert set(server) == {"decode-0", "prefill-0", "router"}
            assert decode["prefill_tokens"] == 0 and decode["kv_adopt_s"]["count"] == 6
            assert server["prefill-0"]["prefill_tokens"] == prompt
            assert server["prefill-0"]["decode_tokens"] == 0
    assert "disaggregated, as the stack measured it" in run.stdout
    assert "  prefill-0: " in run.stdout and "KV adopt mean" in run.stdout
    assert "  router: TTFT parts, mean over 6: admission " in run.stdout


def test_server_metrics_are_differences_of_two_reads():
    from splitserve.bench import server_metrics

    def text(steps, bucket_counts, total):
        les = ("0.005", "0.01", "+Inf")
        rows = [
            "# TYPE splitserve_engine_steps_total counter",
            f"splitserve_engine_steps_total {steps}",
            "# TYPE splitserve_iteration_duration_seconds histogram",
        ]
        rows += [f'splitserve_iteration_duration_seconds_bucket{{le="{le}"}} {c}' for le, c in zip(les, bucket_counts)]
        rows += [
            f"splitserve_iteration_duration_seconds_count {bucket_counts[-1]}",
            f"splitserve_iteration_duration_seconds_sum {total}",
            "# TYPE other_total counter",
            "other_total 5",
        ]
        return "\n".join(rows) + "\n"

    before = server_metrics.parse(text(10, (4, 9, 10), 0.06))
    after = server_metrics.parse(text(110, (4, 9, 110), 2.06))  # 100 more steps, all over 10 ms
    got = server_metrics.summarize({"decode-0": before, "router": before}, {"decode-0": after, "router": None})
    assert set(got) == {"decode-0"}
    row = got["decode-0"]
    assert row["steps"] == 100
    assert row["step_s"]["count"] == 100 and row["step_s"]["mean"] == pytest.approx(0.02)
    assert row["step_s"]["p50_le"] is None and row["step_s"]["p99_le"] is None  # above the largest bucket
    assert server_metrics.lines({"d": row}) == [
        "  d: 100 steps, mean 20.0 ms (median over the largest bucket, p99 over the largest bucket), 0% graphed"
    ]
    after = server_metrics.parse(text(110, (54, 108, 110), 0.66))  # of 100: 50 <= 5 ms, 49 <= 10 ms, 1 more
    row = server_metrics.summarize({"d": before}, {"d": after})["d"]
    assert row["step_s"]["p50_le"] == 0.005 and row["step_s"]["p99_le"] == 0.01
    assert server_metrics.lines({"d": row}) == [
        "  d: 100 steps, mean 6.0 ms (median <= 5 ms, p99 <= 10 ms), 0% graphed"
    ]
    # a CUDA worker's: the forwards' time on the device besides
    device = (
        "# TYPE splitserve_iteration_device_seconds histogram\n"
        'splitserve_iteration_device_seconds_bucket{le="+Inf"} %d\n'
        "splitserve_iteration_device_seconds_count %d\nsplitserve_iteration_device_seconds_sum %g\n"
    )
    row = server_metrics.summarize(
        {"d": server_metrics.parse(text(10, (4, 9, 10), 0.06) + device % (10, 10, 0.03))},
        {"d": server_metrics.parse(text(110, (54, 108, 110), 0.66) + device % (110, 110, 0.43))},
    )["d"]
    assert row["step_device_s"]["count"] == 100 and row["step_device_s"]["mean"] == pytest.approx(0.004)
    assert server_metrics.lines({"d": row}) == [
        "  d: 100 steps, mean 6.0 ms (median <= 5 ms, p99 <= 10 ms), 0% graphed; forward on the device mean 4.0 ms"
    ]


def test_bench_rejects_a_bad_compare():
    run = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "bench", "--compare", "static,fast"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SPLITSERVE_BENCH_DIR": "/nonexistent"},
    )
    assert run.returncode == 2


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "x"', "w.jsonl:2: not JSON"),
        ("[1, 2]", "w.jsonl:2: must be a JSON object, got list"),
        ('{"max_tokens": 4}', "w.jsonl:2: prompt_token_ids (or prompt) is required"),
        ('{"prompt_token_ids": [], "max_tokens": 4}', "w.jsonl:2: prompt_token_ids must be a non-empty list"),
        ('{"prompt_token_ids": [1, -2], "max_tokens": 4}', "w.jsonl:2: prompt_token_ids must be a non-empty list"),
        ('{"prompt_token_ids": [1, "a"], "max_tokens": 4}', "w.jsonl:2: prompt_token_ids must be a non-empty list"),
        ('{"prompt_token_ids": [1]}', "w.jsonl:2: max_tokens must be an integer >= 1, got None"),
        ('{"prompt_token_ids": [1], "max_tokens": 0}', "w.jsonl:2: max_tokens must be an integer >= 1, got 0"),
        ('{"prompt_token_ids": [1], "max_tokens": "8"}', "w.jsonl:2: max_tokens must be an integer >= 1, got '8'"),
    ],
)
def test_a_workload_line_that_is_not_a_request_is_refused_naming_its_line_and_field(tmp_path, line, message):
    from splitserve.bench.workload import load_workload

    path = tmp_path / "w.jsonl"
    path.write_text('{"id": "ok", "prompt_token_ids": [1, 2], "max_tokens": 3}\n' + line + "\n")
    with pytest.raises(ValueError) as e:  # not: KeyError, TypeError or a JSON error with no line
        load_workload(str(path), tokenize=lambda p: [7] * len(p))
    assert str(e.value).startswith(str(tmp_path / message)), str(e.value)


def test_a_workload_of_prompts_alone_is_tokenized_and_ids_default_to_the_line(tmp_path):
    from splitserve.bench.workload import load_workload

    path = tmp_path / "w.jsonl"
    path.write_text(
        '{"prompt": "abc", "max_tokens": 2}\n\n{"id": "b", "prompt": "hello", "max_tokens": 5}\n'
        '{"prompt": "no ids", "prompt_token_ids": [4, 5], "max_tokens": 1}\n'
    )
    items = load_workload(str(path), tokenize=lambda p: [ord(c) for c in p])
    assert [(i.id, i.prompt_token_ids, i.max_tokens) for i in items] == [
        ("1", [97, 98, 99], 2),
        ("b", [104, 101, 108, 108, 111], 5),
        ("4", [4, 5], 1),
    ]
    with pytest.raises(ValueError, match="w.jsonl:1: prompt_token_ids is required here"):
        load_workload(str(path))  # callers that cannot tokenize say so


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rate", "-1"], "--rate takes numbers > 0, got -1"),
        (["--rate", "nan"], "--rate takes numbers > 0, got nan"),
        (["--rate", "1,x"], "--rate takes a comma list of numbers, got 'x'"),
        (["--concurrency", "0"], "--concurrency takes whole numbers > 0, got 0"),
        (["--concurrency", "2.5"], "--concurrency takes whole numbers > 0, got 2.5"),
        (["--input-len", "9-3"], "--input-len takes N or LO-HI tokens"),
        (["--output-len", "x"], "--output-len takes N or LO-HI tokens"),
        (["--requests", "-1"], "--requests must be >= 0, got -1"),
        (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
        (["--timeout", "0"], "--timeout must be > 0 seconds"),
        (["--knee-factor", "1"], "--knee-factor must be > 1"),
        (["--ttft-slo-ms", "-5"], "--ttft-slo-ms must be > 0"),
        (["--decode", "0"], "--decode must be >= 1, got 0"),
    ],
)
def test_bench_flags_out_of_range_are_refused_naming_the_flag(argv, message, capsys, tmp_path):
    import argparse

    from splitserve.bench import cli

    root = argparse.ArgumentParser()
    cli.add_parser(root.add_subparsers())
    args = root.parse_args(["bench", "--address", "127.0.0.1:1", "--out", str(tmp_path / "out"), *argv])
    assert cli.main(args) == 2  # not: most of these ran, and wrote results for nothing
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_security_bench_alternates_two_stacks_and_reports_both_costs(tiny_model_dir, tmp_path, monkeypatch):
    """security_bench on the tiny model, two requests a round: each round runs both stacks, the
    first alternating; the light pairs come out paired."""
    from splitserve.bench import security_bench

    folder = tmp_path / "w"
    folder.mkdir()
    for name in ("workload_mixed.jsonl", "workload_short.jsonl"):
        lines = [json.dumps({"prompt_token_ids": [5 + i, 40, 41, 42 + i], "max_tokens": 3}) for i in range(3)]
        (folder / name).write_text("\n".join(lines) + "\n")
    for name, value in (("MODEL", tiny_model_dir), ("KV_CACHE_BYTES", 16 << 20), ("ARENA_BYTES", 16 << 20)):
        monkeypatch.setenv(f"SPLITSERVE_{name}", str(value))
    monkeypatch.setenv("SPLITSERVE_PREFILL_KV_CACHE_BYTES", str(16 << 20))
    out = tmp_path / "security.json"
    argv = ["--workloads", str(folder), "--requests", "2", "--rounds", "2", "--light", "3", "--light-gap-ms", "0"]
    assert security_bench.main([*argv, "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["first"] for r in res["rounds"]] == ["plain", "secure"]
    for r in res["rounds"]:
        assert r["plain"]["output_tokens"] == r["secure"]["output_tokens"] == 6
        assert r["throughput_ratio"] == r["secure"]["output_tok_per_s"] / r["plain"]["output_tok_per_s"]
    assert len(res["ttft_added_ms"]) == 3 and all(len(v) == 3 for v in res["light_ttft_ms"].values())
    added = [s - p for s, p in zip(res["light_ttft_ms"]["secure"], res["light_ttft_ms"]["plain"])]
    assert res["ttft_added_ms"] == added
