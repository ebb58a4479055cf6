"""The handoff benchmark measures full copies unless told otherwise, and says what it copied:
the decode worker's prefix cache held the repeated prompt, and a handoff that copied a fraction
of the KV was reported as a rate above memcpy's."""

from __future__ import annotations

import json

from splitserve.bench import handoff_bench


def run(tmp_path, *flags) -> dict:
    out = tmp_path / f"handoff{len(flags)}.json"
    assert handoff_bench.main(["--reps", "3", "--tokens", "64", "--out", str(out), *flags]) == 0
    return json.loads(out.read_text())


def test_with_the_workers_cache_on_each_handoff_still_copies_the_whole_kv(smol_loaded, tmp_path, capsys):
    got = run(tmp_path, "--prefix-cache", "on")
    row = got["sizes"]["64"]
    assert got["mode"] == "full" and got["prefix_cache"] is True
    assert row["kv_bytes"] == 64 * 30 * 2 * 3 * 64 * 4  # SmolLM2's KV, fp32
    for transport in ("shm", "grpc"):
        assert row[transport]["copied_bytes"] == row["kv_bytes"], transport
        assert row[transport]["gbps"] < got["memcpy_gbps"]
    assert "full copies; the decode worker's prefix cache is on" in capsys.readouterr().out


def test_a_partial_handoff_is_labelled_and_copies_only_what_the_worker_lacks(smol_loaded, tmp_path, capsys):
    got = run(tmp_path, "--partial")
    row = got["sizes"]["64"]
    assert got["mode"] == "partial" and got["prefix_cache"] is True
    # after the first repetition the worker holds the prompt's whole blocks: it copies the rest
    assert row["shm"]["copied_bytes"] < row["kv_bytes"]
    assert "partial copies" in capsys.readouterr().out
