"""The service tests' stacks: one shared stack (two routers) and its client, and the reference outputs
of the in-process engine they are checked against."""

import pytest

from splitserve.client import Client
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.sampling import SamplingParams

from .common import (
    LOGPROBS_KW,
    PROMPT_LP_KW,
    PROMPT_LP_TEXT,
    admission_counts,
    assert_idle,
    finish_stack,
    free_port,
    start_stack,
)


@pytest.fixture(scope="package")
def stack():
    # a second router for Abort's tests; masks of formats up to 2 ms, for a clear margin in the test of
    # one that turns costly while generating (~7 ms a mask; the other formats' take below 0.7 ms)
    s = start_stack(max_queue_requests=64, max_queue_tokens=1 << 20, routers=2, max_mask_ms=2.0, http_port=free_port())
    yield s
    finish_stack(s)


@pytest.fixture(scope="package")
def client(stack):
    with Client(stack.router_address) as c:
        yield c


@pytest.fixture(scope="package")
def reference_prompts(mixed_workload):
    # 32 prompts of mixed lengths (cut so the suite stays quick), each with its own output length
    items = mixed_workload[:32]
    return [(it["prompt_token_ids"][: 20 + 5 * i], 4 + i % 9) for i, it in enumerate(items)]


@pytest.fixture(scope="package")
def reference_outputs(smol_loaded, reference_prompts):
    eng = LLMEngine(EngineConfig(kv_cache_bytes=256 << 20), loaded=smol_loaded)
    return eng.generate(
        [p for p, _ in reference_prompts], [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in reference_prompts]
    )


@pytest.fixture(scope="package")
def reference_logprobs(smol_loaded):
    """(prompt, tokens, TokenLogprobs) of LOGPROBS_KW's request, from the in-process engine."""
    ids = smol_loaded.tokenizer.encode("The capital of France is")
    eng = LLMEngine(EngineConfig(kv_cache_bytes=64 << 20), loaded=smol_loaded)
    eng.add_request("lp", ids, SamplingParams(**LOGPROBS_KW))
    tokens, logprobs = [], []
    while eng.has_unfinished():
        for out in eng.step():
            tokens.extend(out.new_token_ids)
            logprobs.extend(out.new_logprobs)
    return ids, tokens, logprobs


@pytest.fixture(scope="package")
def reference_prompt_logprobs(smol_loaded):
    """(prompt, tokens, the prompt's TokenLogprobs) of PROMPT_LP_KW's request, from the in-process engine."""
    ids = smol_loaded.tokenizer.encode(PROMPT_LP_TEXT)
    eng = LLMEngine(EngineConfig(kv_cache_bytes=64 << 20), loaded=smol_loaded)
    eng.add_request("plp", ids, SamplingParams(**PROMPT_LP_KW))
    tokens, prompt = [], None
    while eng.has_unfinished():
        for out in eng.step():
            tokens.extend(out.new_token_ids)
            prompt = out.prompt_logprobs if out.prompt_logprobs is not None else prompt
    assert len(ids) > 16 and len(prompt) == len(ids) - 1
    return ids, tokens, prompt


@pytest.fixture(scope="package")
def other_router(stack):
    """A client of the stack's second router: it shares the queue, and holds none of `client`'s streams."""
    with Client(stack.router_addresses[1]) as c:
        yield c


@pytest.fixture(scope="package")
def small_queue_stack_of_module():
    s = start_stack(max_queue_requests=8, max_queue_tokens=1 << 20, replay_max_tokens=8, http_port=free_port())
    yield s
    finish_stack(s)


@pytest.fixture
def small_queue_stack(small_queue_stack_of_module):
    """One stack for the module's small-queue tests: each must leave it as it found it, which the
    leak checks of finish_stack assert after each; the stack stops at the end of the module."""
    s = small_queue_stack_of_module
    assert admission_counts(s) == [0, 0]
    yield s
    assert_idle(s)
