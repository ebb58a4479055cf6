"""Protobuf <-> domain objects, at the edges only."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from splitserve.engine.errors import InvalidRequestError
from splitserve.engine.outputs import TokenLogprob
from splitserve.engine.params import MAX_LOGIT_BIAS_ENTRIES, SamplingParams, check_stop_counts
from splitserve.engine.structured import MAX_CHOICES, StructuredOutput
from splitserve_proto.v1 import generation_pb2 as gen_pb
from splitserve_proto.v1 import worker_pb2 as w_pb

if TYPE_CHECKING:  # the layout needs torch, which the router does without
    from splitserve.handoff.layout import KVExport

_REQUEST_ID = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


def sampling_from_pb(sp: gen_pb.SamplingParams, default_max_tokens: int) -> SamplingParams:
    # Counted before the lists are copied: 350,000 stop strings took 0.17 s of the event loop.
    check_stop_counts(len(sp.stop), len(sp.stop_token_ids))
    if len(sp.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(
            "sampling.logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(sp.logit_bias)}"
        )
    return SamplingParams(
        max_tokens=sp.max_tokens if sp.HasField("max_tokens") else default_max_tokens,
        temperature=sp.temperature if sp.HasField("temperature") else 0.0,
        top_p=sp.top_p if sp.HasField("top_p") else 1.0,
        top_k=sp.top_k if sp.HasField("top_k") else 0,
        seed=sp.seed if sp.HasField("seed") else None,
        stop=tuple(sp.stop),
        stop_token_ids=tuple(sp.stop_token_ids),
        min_tokens=sp.min_tokens,
        ignore_eos=sp.ignore_eos,
        include_stop_str_in_output=sp.include_stop_str_in_output,
        skip_special_tokens=sp.skip_special_tokens if sp.HasField("skip_special_tokens") else True,
        n=sp.n if sp.HasField("n") else 1,
        logprobs=sp.logprobs if sp.HasField("logprobs") else None,
        prompt_logprobs=sp.prompt_logprobs if sp.HasField("prompt_logprobs") else None,
        presence_penalty=sp.presence_penalty if sp.HasField("presence_penalty") else 0.0,
        frequency_penalty=sp.frequency_penalty if sp.HasField("frequency_penalty") else 0.0,
        repetition_penalty=sp.repetition_penalty if sp.HasField("repetition_penalty") else 1.0,
        min_p=sp.min_p if sp.HasField("min_p") else 0.0,
        logit_bias=tuple(sp.logit_bias.items()),
        structured_output=structured_from_pb(sp.structured_output) if sp.HasField("structured_output") else None,
    )


def structured_from_pb(so: gen_pb.StructuredOutput) -> StructuredOutput:
    kind = so.WhichOneof("format")
    if kind is None:
        raise InvalidRequestError(
            "sampling.structured_output", "set, but with none of json_schema, json_object, regex, choice or lark"
        )
    if kind == "json_object":
        if not so.json_object:
            raise InvalidRequestError("sampling.structured_output.json_object", "must be true when set")
        return StructuredOutput(kind, disable_any_whitespace=so.disable_any_whitespace)
    if kind == "choice":
        if len(so.choice.values) > MAX_CHOICES:  # counted before the list is copied
            raise InvalidRequestError(
                "sampling.structured_output.choice", f"at most {MAX_CHOICES} strings, got {len(so.choice.values)}"
            )
        return StructuredOutput(kind, tuple(so.choice.values), so.disable_any_whitespace)
    return StructuredOutput(kind, getattr(so, kind), so.disable_any_whitespace)


def structured_to_pb(fmt: StructuredOutput) -> gen_pb.StructuredOutput:
    so = gen_pb.StructuredOutput(disable_any_whitespace=fmt.disable_any_whitespace)
    if fmt.kind == "json_object":
        so.json_object = True
    elif fmt.kind == "choice":
        so.choice.values.extend(fmt.value)
    else:
        setattr(so, fmt.kind, fmt.value)
    return so


def sampling_to_pb(p: SamplingParams) -> gen_pb.SamplingParams:
    sp = gen_pb.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        min_tokens=p.min_tokens,
        ignore_eos=p.ignore_eos,
        include_stop_str_in_output=p.include_stop_str_in_output,
    )
    if p.seed is not None:
        sp.seed = p.seed
    if not p.skip_special_tokens:
        sp.skip_special_tokens = False
    if p.n != 1:
        sp.n = p.n
    if p.logprobs is not None:
        sp.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        sp.prompt_logprobs = p.prompt_logprobs
    if p.presence_penalty:
        sp.presence_penalty = p.presence_penalty
    if p.frequency_penalty:
        sp.frequency_penalty = p.frequency_penalty
    if p.repetition_penalty != 1.0:
        sp.repetition_penalty = p.repetition_penalty
    if p.min_p:
        sp.min_p = p.min_p
    sp.logit_bias.update(dict(p.logit_bias))
    if p.structured_output is not None:
        sp.structured_output.CopyFrom(structured_to_pb(p.structured_output))
    return sp


def logprobs_to_pb(logprobs) -> list[gen_pb.TokenLogprob]:
    return [
        gen_pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            rank=lp.rank,
            top_logprobs=[gen_pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
        for lp in logprobs or ()
    ]


def logprobs_from_pb(logprobs) -> list[TokenLogprob]:
    return [
        TokenLogprob(lp.token_id, lp.logprob, lp.rank, tuple((t.token_id, t.logprob) for t in lp.top_logprobs))
        for lp in logprobs
    ]


def check_request_id(request_id: str, required: bool = False) -> None:
    """Generate's id is optional; Abort and GetRequest need one. Either way it must have the form
    of an id Generate accepts, so an id that names no request cannot become a key in Redis."""
    if not request_id:
        if required:
            raise InvalidRequestError("request_id", "must be set")
        return
    if not _REQUEST_ID.match(request_id):
        raise InvalidRequestError("request_id", "must be 1-128 characters of letters, digits, '_', '.', ':' or '-'")


CACHE_SALT_MAX_CHARS = 256


def check_cache_salt(salt: str) -> None:
    if len(salt) > CACHE_SALT_MAX_CHARS:
        raise InvalidRequestError("cache_salt", f"at most {CACHE_SALT_MAX_CHARS} characters, got {len(salt)}")


def input_of(req: gen_pb.GenerateRequest) -> tuple[str, object]:
    """('prompt', str) | ('messages', list[dict]) | ('token_ids', list[int]); raises naming the field."""
    kind = req.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError("input", "one of prompt, messages or token_ids is required")
    if kind == "prompt":
        if not req.prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        return kind, req.prompt
    if kind == "messages":
        msgs = [{"role": m.role, "content": m.content} for m in req.messages.messages]
        if not msgs:
            raise InvalidRequestError("messages", "must not be empty")
        return kind, msgs
    ids = list(req.token_ids.ids)
    if not ids:
        raise InvalidRequestError("token_ids", "must not be empty")
    return kind, ids


def sequence_to_pb(
    export: KVExport, *, finish_reason: str = "", queue_ms: float = 0.0, prefill_ms: float = 0.0, traceparent: str = ""
) -> w_pb.SequenceState:
    return w_pb.SequenceState(
        request_id=export.request_id,
        prompt_len=export.prompt_len,
        token_ids=export.token_ids,
        sampling=sampling_to_pb(export.params),
        generator_state=export.generator_state or b"",
        finish_reason=finish_reason or export.finish_reason,
        queue_ms=queue_ms,
        prefill_ms=prefill_ms,
        traceparent=traceparent,
        cache_salt=export.cache_salt,
        logprobs=logprobs_to_pb(export.logprobs),
        prompt_logprobs=logprobs_to_pb(export.prompt_logprobs),
        resumed_tokens=export.resumed,
        resumed_chars=export.resumed_chars,
    )


def export_from_pb(seq: w_pb.SequenceState, handle: w_pb.KVHandle) -> KVExport:
    from splitserve.handoff.layout import KVExport

    return KVExport(
        request_id=seq.request_id,
        prompt_len=seq.prompt_len,
        token_ids=list(seq.token_ids),
        params=sampling_from_pb(seq.sampling, 16),
        generator_state=seq.generator_state or None,
        num_tokens=handle.num_tokens,
        fingerprint=handle.fingerprint,
        layout_version=handle.layout_version,
        dtype=handle.dtype,
        nbytes=handle.length,
        cache_salt=seq.cache_salt,
        start=handle.start_token,
        logprobs=logprobs_from_pb(seq.logprobs),
        prompt_logprobs=logprobs_from_pb(seq.prompt_logprobs),
        finish_reason=seq.finish_reason,
        resumed=seq.resumed_tokens,
        resumed_chars=seq.resumed_chars,
    )
