"""The router's OpenAI-compatible HTTP, driven by the official `openai` package against a real stack:
completions and chat, streamed and not, equal to the gRPC path token for token; each error class in
OpenAI's shape; X-Request-Id; and a client that disconnects mid-stream leaves no KV behind."""

import json
import threading
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from service_helpers import kv_idle, wait_for

from splitserve.client import Client, InvalidArgument, NotFound, ResourceExhausted

from .common import admission_counts, prefill_paused, state_of

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three primary colours."}]


@pytest.fixture(scope="module")
def oai(stack):
    with openai.OpenAI(base_url=f"http://{stack.router_http_address}/v1", api_key="none", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def http_get(stack, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://{stack.router_http_address}{path}", timeout=10) as f:
            return f.status, json.load(f)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_models_and_health_name_the_served_model_not_its_path(stack, oai):
    models = oai.models.list().data
    assert len(models) == 1
    assert models[0].id == "SmolLM2-135M-Instruct.Q4_1" and "/" not in models[0].id
    assert models[0].owned_by == "splitserve"
    assert http_get(stack, "/health") == (200, {"status": "ok"})


def test_greedy_completion_equals_the_grpc_path_streamed_or_not(oai, model, client):
    want = client.generate(PROMPT, max_tokens=12, ignore_eos=True, logprobs=0)
    got = oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
    )
    choice = got.choices[0]
    assert choice.text == want.text
    assert choice.finish_reason == "length"
    assert choice.logprobs.tokens == [lp.token for lp in want.logprobs]
    assert choice.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-6)
    assert got.usage.prompt_tokens == want.usage.prompt_tokens and got.usage.completion_tokens == 12
    assert got.object == "text_completion" and got.model == model
    chunks = list(
        oai.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12  # include_usage: last


def test_greedy_chat_equals_the_grpc_path_streamed_or_not(oai, model, client):
    want = client.generate(messages=CHAT, max_tokens=16)
    got = oai.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=16, temperature=0)
    assert got.choices[0].message.content == want.text
    assert got.choices[0].message.role == "assistant"
    assert got.usage.completion_tokens == want.usage.completion_tokens
    assert got.choices[0].finish_reason == {"eos": "stop"}.get(want.finish_reason, want.finish_reason)
    chunks = list(oai.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == got.choices[0].finish_reason


def test_sampling_parameters_reach_the_engine(oai, model, client):
    """n with a seed, stop, logit_bias, response_format and vLLM's extras each change the output as
    the same fields do over gRPC."""
    two = oai.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=2, seed=3, temperature=1.0,
                                 extra_body={"ignore_eos": True, "top_k": 20})  # fmt: skip
    grpc_two = client.generate(PROMPT, max_tokens=6, n=2, seed=3, temperature=1.0, top_k=20, ignore_eos=True)
    assert [c.text for c in two.choices] == [c.text for c in grpc_two.choices]
    assert two.usage.completion_tokens == 12
    stopped = oai.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stop=[" Paris"])
    assert "Paris" not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    token = client.tokenize(" banana").token_ids[0]
    forced = oai.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0,
                                    logit_bias={str(token): 100})  # fmt: skip
    assert forced.choices[0].text == " banana" * 3
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    js = oai.chat.completions.create(model=model, messages=CHAT, max_tokens=40, temperature=0, response_format=fmt)
    assert json.loads(js.choices[0].message.content)["colour"] in ("red", "green", "blue")
    long = oai.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0,
                                  extra_body={"min_tokens": 5, "repetition_penalty": 1.3, "min_p": 0.1})  # fmt: skip
    assert long.usage.completion_tokens == 5


def test_x_request_id_is_the_request_id(oai, model, client):
    got = oai.completions.with_raw_response.create(
        model=model, prompt=PROMPT, max_tokens=2, extra_headers={"X-Request-Id": "http-rid-1"}
    )
    assert got.headers["x-request-id"] == "http-rid-1"
    assert got.parse().id == "cmpl-http-rid-1"
    assert client.get_request("http-rid-1").state == "finished"


def test_each_error_class_has_its_status_and_openais_shape(stack, oai, model):
    with pytest.raises(openai.BadRequestError) as e:  # a type the API layer refuses, naming the field
        oai.completions.create(model=model, prompt=PROMPT, max_tokens="many")
    assert e.value.status_code == 400 and e.value.param == "max_tokens" and "max_tokens" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # a range the servicer refuses, naming the field
        oai.completions.create(model=model, prompt=PROMPT, temperature=-1)
    assert e.value.param == "temperature" and e.value.code == "INVALID_ARGUMENT"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=[{"role": "user"}])
    assert e.value.param == "messages[0]"
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="gpt-4", prompt=PROMPT)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    oai.completions.create(model=model, prompt="One.", max_tokens=1, extra_headers={"X-Request-Id": "http-dup"})
    with pytest.raises(openai.ConflictError) as e:  # the id again, for another request
        oai.completions.create(model=model, prompt="Two.", max_tokens=1, extra_headers={"X-Request-Id": "http-dup"})
    assert e.value.code == "ALREADY_EXISTS"
    req = urllib.request.Request(
        f"http://{stack.router_http_address}/v1/completions", data=b"{not json", method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400 and json.load(e.value)["error"]["type"] == "invalid_request_error"


def fillers(stack, n: int) -> list[threading.Thread]:
    """n requests queued (started on threads, each with its own client) while prefill is paused."""

    def one(i):
        with Client(stack.router_address) as c:
            c.generate(f"Filler {i}.", max_tokens=2, ignore_eos=True, timeout=120)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def test_a_full_queue_is_429_with_retry_after_as_grpc_is_resource_exhausted(small_queue_stack):
    """The same Lua admission answers both: with the queue at its bound, a streamed HTTP request is
    429 (before its stream starts) with Retry-After, and a gRPC one RESOURCE_EXHAUSTED."""
    stack = small_queue_stack
    with openai.OpenAI(base_url=f"http://{stack.router_http_address}/v1", api_key="none", max_retries=0) as oai:
        with prefill_paused(stack):
            fill = fillers(stack, 6)
            wait_for(lambda: admission_counts(stack)[0] == 6, what="the queue at its refusal point")
            with pytest.raises(openai.RateLimitError) as e:
                oai.completions.create(model=oai.models.list().data[0].id, prompt=PROMPT, max_tokens=2, stream=True)
            with Client(stack.router_address) as c, pytest.raises(grpc.RpcError) as g:
                c.generate(PROMPT, max_tokens=2)
        for t in fill:
            t.join(60)
    assert e.value.status_code == 429 and e.value.code == "RESOURCE_EXHAUSTED"
    assert int(e.value.response.headers["retry-after"]) >= 1
    assert g.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # the gRPC refusal's google.rpc details, read by the client into its typed error
    assert isinstance(g.value, ResourceExhausted) and g.value.reason == "QUEUE_FULL"
    assert g.value.retry_after_s == stack.settings.retry_after_ms / 1000
    assert dict(g.value.trailing_metadata())["grpc-retry-pushback-ms"] == str(stack.settings.retry_after_ms)
    assert e.value.body["message"].split(";")[0] == g.value.details().split(";")[0]  # "queue is full (...)"


def test_a_client_that_disconnects_mid_stream_leaves_no_kv(stack, oai, model, client):
    stream = oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=400, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": "http-gone"},
    )  # fmt: skip
    got = [next(stream) for _ in range(3)]
    assert all(c.choices[0].text for c in got)
    stream.close()  # the connection goes with it
    wait_for(lambda: state_of(client, "http-gone") == "cancelled", what="the request cancelled")
    wait_for(lambda: kv_idle(stack), timeout=20, what="its KV freed at the workers")
    assert client.generate(PROMPT, max_tokens=2).usage.completion_tokens == 2  # the stack serves on


def test_the_model_has_a_name_and_a_card_over_grpc_too(stack, client, model):
    """ListModels and GetModelInfo over gRPC name the same model as /v1/models, with what the
    decode workers registered; a request naming another model is NOT_FOUND, as over HTTP."""
    (info,) = client.list_models()
    assert info.name == model and info.context_length == 8192 and info.vocab_size == 49152
    assert info.dtype == "float32" and len(info.fingerprint) >= 16
    assert client.get_model_info() == info == client.get_model_info(model)
    with pytest.raises(grpc.RpcError) as e:
        client.get_model_info("llama-70b")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "llama-70b" in e.value.details()
    assert client.generate(PROMPT, max_tokens=2, model=model).usage.completion_tokens == 2
    with pytest.raises(NotFound) as e:
        client.generate(PROMPT, max_tokens=2, model="llama-70b")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and e.value.details().startswith("model: ")
    assert e.value.reason == "MODEL_NOT_FOUND"


def test_errors_carry_google_rpc_details_any_grpc_client_can_read(client):
    """INVALID_ARGUMENT names the field in a BadRequest; every error has an ErrorInfo with a stable
    reason; the message is the status's own. grpcio-status reads them from the call, and the
    client raises them as typed errors (still grpc.RpcError)."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    with pytest.raises(InvalidArgument) as e:
        client.generate(PROMPT, max_tokens=2, temperature=-1.0)
    assert isinstance(e.value, grpc.RpcError) and e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.field_violations == [("sampling.temperature", e.value.details().split(": ", 1)[1])]
    assert e.value.reason == "INVALID_ARGUMENT" and e.value.retry_after_s is None
    status = rpc_status.from_call(e.value)  # the standard reader: checks code and message agree
    kinds = [d.TypeName() for d in status.details]
    assert kinds == ["google.rpc.ErrorInfo", "google.rpc.BadRequest"]
    info = error_details_pb2.ErrorInfo()
    status.details[0].Unpack(info)
    assert info.domain == "splitserve.v1"
    with pytest.raises(NotFound) as e:
        client.get_request("no-such-request-anywhere")
    assert e.value.reason == "NOT_FOUND"
    with pytest.raises(InvalidArgument) as e:  # a stream's failure is typed too
        list(client.generate_stream(PROMPT, max_tokens=0))
    assert e.value.field_violations[0][0] == "sampling.max_tokens"
