"""The benchmark workloads ship inside the package, and the generator draws more of the same kind
with SmolLM2's own tokenizer."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

import splitserve
from splitserve.bench import make_workload as mk
from splitserve.bench.workload import WORKLOAD_DIR, default_workload_dir, load_workload
from splitserve.engine.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok(smol_folder):
    return load_tokenizer(smol_folder)


def test_the_workloads_live_in_the_package_and_are_the_default(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_BENCH_DIR", raising=False)
    package = pathlib.Path(splitserve.__file__).resolve().parent
    assert pathlib.Path(default_workload_dir()) == package / "bench" / "workloads" == pathlib.Path(WORKLOAD_DIR)
    assert len(load_workload(os.path.join(WORKLOAD_DIR, "workload_mixed.jsonl"))) == 128
    assert len(load_workload(os.path.join(WORKLOAD_DIR, "workload_short.jsonl"))) == 256
    monkeypatch.setenv("SPLITSERVE_BENCH_DIR", "/elsewhere")
    assert default_workload_dir() == "/elsewhere"


@pytest.mark.parametrize("name", ["workload_mixed.jsonl", "workload_short.jsonl"])
def test_each_shipped_prompts_token_ids_are_smollm2s_tokenization_of_its_prompt(tok, name):
    with open(os.path.join(WORKLOAD_DIR, name)) as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        assert row["prompt_token_ids"] == tok.encode(row["prompt"]), row["id"]
        assert row["prompt_tokens"] == len(row["prompt_token_ids"]), row["id"]


@pytest.mark.parametrize("kind", ["mixed", "short"])
def test_the_generator_draws_the_kinds_shape_and_the_same_file_for_the_same_seed(tok, kind):
    rows = mk.make_workload(kind, tok, "seed-a", requests=24)
    assert len(rows) == 24 and len({r["id"] for r in rows}) == 24
    _, (lo, hi), chat = mk.KINDS[kind]
    out_lo, out_hi = (16, 256) if kind == "mixed" else (8, 64)
    for row in rows:
        assert row["prompt_token_ids"] == tok.encode(row["prompt"])
        assert row["prompt_tokens"] == len(row["prompt_token_ids"])
        assert row["prompt_tokens"] <= hi and row["prompt_tokens"] >= (lo // 2 if chat else 1), row
        assert out_lo <= row["max_tokens"] <= out_hi
        assert ("<|im_start|>user\n" in row["prompt"]) == chat  # the model's chat template, or plain text
    assert mk.make_workload(kind, tok, "seed-a", requests=24) == rows
    assert mk.make_workload(kind, tok, "seed-b", requests=24) != rows
    assert [r["prompt_tokens"] for r in rows] != [rows[0]["prompt_tokens"]] * 24  # lengths are drawn


def test_the_generators_command_writes_a_file_load_workload_reads(smol_folder, tmp_path):
    out = tmp_path / "w.jsonl"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "splitserve.bench.make_workload",
            "--kind",
            "short",
            "--requests",
            "5",
            "--model",
            smol_folder,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert [w.id for w in load_workload(str(out))] == [f"short-{i:04d}" for i in range(5)]
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "splitserve.bench.make_workload",
            "--kind",
            "short",
            "--requests",
            "0",
            "--model",
            smol_folder,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "requests must be >= 1, got 0" in bad.stderr, bad.stderr
