"""make bench-peers: the table from fake rounds, the figures from fake results, the model folder vLLM
gets, and the OpenAI HTTP load generator against a real (tiny) stack."""

import asyncio
import json
import math
import random
import urllib.request

import pytest

from splitserve.bench import peers_bench
from splitserve.bench.workload import WorkItem
from splitserve.service.settings import Settings
from splitserve.stack import Stack


def fake(tok_s: float, ttft: float = 100.0) -> dict:
    return {
        "output_tok_per_s": tok_s,
        "ttft_p50_ms": ttft,
        "ttft_p99_ms": ttft * 3,
        "tpot_p50_ms": 50.0,
        "e2e_p50_ms": 2000.0,
    }


def test_the_table_gives_each_servers_range_and_the_ratio_of_the_medians():
    rounds = [
        {
            "short": {"splitserve": fake(100), "vllm": fake(110)},
            "poisson": {"splitserve": fake(9, 300), "vllm": fake(9, 400)},
        },
        {
            "short": {"splitserve": fake(104), "vllm": fake(112)},
            "poisson": {"splitserve": fake(9, 340), "vllm": fake(9, 400)},
        },
    ]
    rows, md = peers_bench.table(rounds)
    short = [r for r in rows if r["load"] == "short"]
    assert [r["metric"] for r in short] == ["output_tok_per_s"]  # a closed loop: throughput only
    assert short[0]["splitserve"] == [100, 104] and short[0]["ratio"] == pytest.approx(102 / 111)
    poisson = {r["metric"]: r for r in rows if r["load"] == "poisson"}
    assert "output_tok_per_s" not in poisson  # an open loop's throughput is its arrival rate
    assert poisson["ttft_p50_ms"]["ratio"] == pytest.approx(320 / 400)
    assert "| short | output_tok_per_s | 100.0–104.0 | 110.0–112.0 | 0.92× |" in md
    assert "| poisson | ttft_p99_ms | 900.0–1020.0 | 1200.0 | 0.80× |" in md


def test_summarize_counts_failures_and_times_only_the_requests_that_completed():
    ok = {"ok": True, "ttft_s": 0.1, "e2e_s": 1.1, "tokens": 11, "wall_s": 2.0}
    bad = {"ok": False, "ttft_s": math.nan, "e2e_s": math.nan, "tokens": 0, "wall_s": 2.0, "error": "APIError: x"}
    s = peers_bench.summarize([ok, dict(ok, ttft_s=0.3, e2e_s=1.3), bad])
    assert s["failed"] == 1 and s["errors"] == ["APIError: x"]
    assert s["output_tokens"] == 22 and s["output_tok_per_s"] == 11.0
    assert s["ttft_p50_ms"] == pytest.approx(200.0) and s["tpot_p50_ms"] == pytest.approx(100.0)


def test_vllm_gets_the_folder_without_the_gguf_quantization_config(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(
        json.dumps({"model_type": "llama", "quantization_config": {"quant_method": "gguf"}})
    )
    (src / "model.safetensors").write_bytes(b"weights")
    dst = peers_bench.vllm_model_folder(str(src), str(tmp_path / "run"))
    assert json.loads(open(f"{dst}/config.json").read()) == {"model_type": "llama"}
    assert open(f"{dst}/model.safetensors", "rb").read() == b"weights"
    assert "quantization_config" in (src / "config.json").read_text()  # the cached folder is left as it is


def test_the_load_generator_streams_completions_over_openai_http(tiny_model_dir):
    settings = Settings.from_env(
        model=tiny_model_dir, kv_cache_bytes=32 << 20, prefill_kv_cache_bytes=32 << 20, arena_bytes=16 << 20
    )
    items = [WorkItem(str(i), "", prompt_token_ids=[5 + i, 40, 41], max_tokens=4 + i) for i in range(3)]
    with Stack(settings, http_port=peers_bench.free_port()) as stack:
        base = f"http://{stack.router_http_address}/v1"
        with urllib.request.urlopen(base + "/models") as r:
            model = json.load(r)["data"][0]["id"]
        closed = asyncio.run(peers_bench.run_load(base, model, items, None))
        opened = asyncio.run(peers_bench.run_load(base, model, items, 50.0, seed=1))
        wrong = asyncio.run(peers_bench.run_load(base, "no-such-model", items[:1], None))
    for results in (closed, opened):
        assert [r["tokens"] for r in results] == [4, 5, 6] and all(r["ok"] for r in results)
        assert all(0 < r["ttft_s"] <= r["e2e_s"] <= r["wall_s"] for r in results)
    rng = random.Random(1)  # the seeded arrival times: each request waits for its own
    first_gap = rng.expovariate(50.0)
    assert opened[1]["t_sent"] >= first_gap and opened[2]["t_sent"] >= first_gap + rng.expovariate(50.0)
    assert not wrong[0]["ok"] and "NotFoundError" in wrong[0]["error"]
