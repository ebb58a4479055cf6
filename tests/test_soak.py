"""The soak's check of memory over a run (tests/soak.py: without chaos, a process whose RSS grew by more
than RSS_GROWTH from the run's second quarter to its last is a problem), on real processes."""

import subprocess
import sys
import types

import soak

MB = 1 << 20

# Sleeps, then (with an argument) takes that many MB more, touched so they are resident, then sleeps.
GROWER = """
import sys, time
time.sleep(2.0)
held = [bytearray(b"x" * (1 << 20)) for _ in range(int(sys.argv[1]))]
time.sleep(60)
"""


def test_a_process_that_keeps_taking_memory_is_found_and_one_that_does_not_is_not(monkeypatch):
    # 4 s sampled: the quarters compared are 1-2 s and 3-4 s, and one process takes 200 MB at about 2 s
    monkeypatch.setattr(soak, "RSS_EVERY_S", 0.1)
    procs = {n: subprocess.Popen([sys.executable, "-c", GROWER, str(n)]) for n in (0, 200)}
    try:
        stack = types.SimpleNamespace(
            procs=[types.SimpleNamespace(name=f"grows-{n}", popen=p) for n, p in procs.items()], redis_proc=procs[0]
        )
        samples: list[tuple] = []
        t0 = soak.time.time()
        soak.memory_loop(stack, t0, t0 + 4.0, samples)
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    growth = {name: (before, after) for name, before, after in soak.memory_growth(samples, 4.0)}
    assert sorted(growth) == ["grows-0", "grows-200", "redis"]
    before, after = growth["grows-200"]
    assert 190 * MB < after - before < 230 * MB, growth
    problems = soak.grown(list((name, *ba) for name, ba in growth.items()))
    assert len(problems) == 1 and problems[0].startswith("grows-200's memory grew from"), problems
    assert soak.rss(procs[0].pid) is None  # gone


def test_growth_is_medians_of_the_second_and_last_quarters_of_one_process_over_the_threshold():
    def run(name, pid, first, second, third, last):  # one sample a second over 40 s, each quarter's value
        return [(t, name, pid, (first, second, third, last)[t // 10]) for t in range(40)]

    samples = (
        run("steady", 1, 900 * MB, 500 * MB, 510 * MB, 520 * MB)  # sized its caches in the first quarter
        + run("leaks", 2, 500 * MB, 500 * MB, 540 * MB, 580 * MB)  # 80 MB and 16%: over both
        + run("small", 3, 50 * MB, 50 * MB, 80 * MB, 110 * MB)  # 60 MB (120%): under 64 MB
        + run("big", 4, 2000 * MB, 2000 * MB, 2100 * MB, 2150 * MB)  # 150 MB but 7.5%: under 10%
        + [(15, "restarted", 5, 100 * MB), (35, "restarted", 6, 900 * MB)]
    )  # two processes: not compared
    samples.append((35, "leaks", 2, 5000 * MB))  # one sample off: the median holds
    growth = soak.memory_growth(samples, 40)
    assert growth == [
        ("big", 2000 * MB, 2150 * MB),
        ("leaks", 500 * MB, 580 * MB),
        ("small", 50 * MB, 110 * MB),
        ("steady", 500 * MB, 520 * MB),
    ]
    assert [p.split("'")[0] for p in soak.grown(growth)] == ["leaks"]
