import json
import os
import pathlib
import tempfile

import pytest
import torch
from engine_helpers import engine_factory_of

from splitserve.bench.workload import WORKLOAD_DIR
from splitserve.engine.config import ModelSpec
from splitserve.engine.loader import load_model

# Without a CUDA device, Triton's interpreter runs the fused kernels on CPU tensors (tests/test_fused.py).
# Read when Triton is imported, which nothing has done yet.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

MIXED = pathlib.Path(WORKLOAD_DIR) / "workload_mixed.jsonl"
REPO = pathlib.Path(__file__).resolve().parents[1]


def pytest_configure(config):
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))


@pytest.fixture(scope="session", autouse=True)
def stack_run_dirs(tmp_path_factory):
    """Stacks started by the tests keep their run dirs (logs, Redis socket, span file) under
    pytest's base temp dir, which pytest prunes to the last three runs, not loose in /tmp."""
    before, before_env = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = os.environ["TMPDIR"] = str(tmp_path_factory.getbasetemp())  # TMPDIR: `splitserve up` children
    yield tempfile.tempdir
    tempfile.tempdir = before
    if before_env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before_env


@pytest.fixture(scope="session", autouse=True)
def stack_forkserver(stack_run_dirs):
    """The stacks' processes are forked from one that has imported torch (splitserve.forkserver):
    each start and restart of a worker skips seconds of imports. Started at the first stack's."""
    from splitserve.forkserver import ForkServer
    from splitserve.stack import use_forkserver

    server = ForkServer()
    use_forkserver(server)
    yield server
    use_forkserver(None)
    server.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Llama (2 layers, GQA 4:2) saved as a safetensors folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.5,  # peaked logits: greedy choices are not near-ties
        eos_token_id=2,
        bos_token_id=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir):
    return load_model(ModelSpec(path=tiny_model_dir))


@pytest.fixture
def tiny_engine_factory(tiny_loaded):
    yield from engine_factory_of(tiny_loaded)


@pytest.fixture(scope="session")
def smol_loaded():
    """The real SmolLM2-135M-Instruct (converted from the wheel's GGUF and cached on first use)."""
    return load_model(ModelSpec())


@pytest.fixture(scope="session")
def smol_folder(smol_loaded) -> str:
    from splitserve.engine.loader import _cache_folder, default_model_path

    return _cache_folder(default_model_path(), ModelSpec().cache_dir)


@pytest.fixture(scope="session")
def mixed_workload() -> list[dict]:
    with open(MIXED) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def redis_socket(tmp_path_factory):
    """A real redis-server of the module's own (no persistence): its unix socket's path."""
    from service_helpers import start_redis

    proc, sock = start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield sock
    finally:
        proc.terminate()
        proc.wait(10)
