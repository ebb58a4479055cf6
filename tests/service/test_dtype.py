"""A stack run in a half-precision dtype: the handoff between its processes keeps it."""

import pytest
import torch
from engine_helpers import hf_greedy, random_prompts
from service_helpers import wait_for, workers

from splitserve.client import Client

from .common import start_stack


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_a_bf16_stack_hands_bf16_kv_over_and_answers_as_transformers_in_bf16(tmp_path, tiny_model_dir, transport):
    """A bf16 checkpoint served with dtype bfloat16 by a prefill and a decode worker: the model card
    says bfloat16, the KV that crosses (shared memory or gRPC) is bf16, two bytes an element, and
    greedy output is transformers' in bf16; afterwards the decode worker holds no KV."""
    from transformers import LlamaForCausalLM

    folder = str(tmp_path / "bf16")
    LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(folder)
    s = start_stack(model=folder, dtype="bfloat16", kv_transport=transport, kv_cache_bytes=16 << 20)
    try:
        (dec,) = workers(s, "decode")
        free = dec["free_kv_tokens"]
        with Client(s.router_address) as c:
            assert c.get_model_info().dtype == "bfloat16"
            for i, prompt in enumerate(random_prompts(2, lo=20, hi=40, seed=4)):
                got = c.generate(token_ids=prompt, max_tokens=10, ignore_eos=True, request_id=f"bf{i}", timeout=60)
                assert list(got.token_ids) == hf_greedy(folder, "bfloat16", prompt, 10)
                info = c.get_request(f"bf{i}")
                # tiny model: 2 layers, K and V, 2 KV heads of 16, 2 bytes each
                assert (info.kv_transport, info.kv_bytes) == (transport, 64 + 2 * 2 * 2 * 16 * 2 * len(prompt))
        wait_for(lambda: workers(s, "decode")[0]["free_kv_tokens"] == free, what="the decode worker's KV freed")
    finally:
        s.stop()
    assert s.shm_segments() == []
