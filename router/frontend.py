"""Validation of a request against the model, the tokenizer and the request's own sampling, before admission."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

from splitserve.engine.config import ModelSpec
from splitserve.engine.errors import InvalidRequestError
from splitserve.engine.loader import load_frontend, served_model_name
from splitserve.engine.params import SamplingParams, check_context, check_vocab
from splitserve.engine.structured import Grammars
from splitserve.router.requests import INLINE_TOKENIZE_CHARS, Sent
from splitserve.service import convert, grpc_server
from splitserve.service.errors import NotFound
from splitserve.service.settings import Settings
from splitserve_proto.v1 import generation_pb2 as gen_pb


class Frontend:
    """What the router knows of the model: tokenizer, vocabulary, context."""

    def __init__(self, settings: Settings):
        spec = ModelSpec(path=settings.model or None, cache_dir=settings.cache_dir)
        self.tokenizer, config, name = load_frontend(spec)
        self.name = served_model_name(settings.served_model_name, name)  # the model's name in the API
        if self.tokenizer is not None:  # worked out now (~20 ms and ~0.7 s of imports), not at the first request
            self.tokenizer.max_token_chars  # noqa: B018
            if self.tokenizer.chat_template:
                try:
                    self.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
                except Exception:  # noqa: BLE001 - a template may refuse this chat; requests get its error
                    pass
        self.vocab = config.vocab_size
        self.context = config.context_length
        self.eos = config.eos_with(self.tokenizer)
        # Structured output's formats are compiled here too, so one that does not is refused before it is queued.
        self.grammars = (
            None if self.tokenizer is None else Grammars(self.tokenizer, self.vocab, self.eos, settings.max_mask_ms)
        )

    def check_model(self, name: str) -> None:
        """A request's model: empty, or the one served."""
        if name and name != self.name:
            raise NotFound(
                f"model: {name!r} is not served here (this stack serves {self.name!r}; see ListModels)",
                reason="MODEL_NOT_FOUND",
            )

    def max_request_bytes(self) -> int:
        """The largest GenerateRequest worth reading: a text the context could hold (4 bytes a
        character at most in UTF-8) and 1 MB for the rest, at least gRPC's usual 4 MB. A larger
        one (48 MB of token ids: parsing it on the event loop held every stream for 0.5 s) is
        refused before it is read. Without a bound on the characters a token covers: 64 MB."""
        chars = self.tokenizer.max_token_chars if self.tokenizer is not None else None
        if self.tokenizer is not None and not chars:
            return grpc_server.MAX_MESSAGE
        return max(4 << 20, 4 * self.context * (chars or 1) + (1 << 20))

    def check_input_size(self, req: gen_pb.GenerateRequest, truncating: bool = False) -> int:
        """How many characters of text the request's input holds (0 for token_ids); raises when the
        input can be seen not to fit the context before tokenizing it, which takes ~0.7 s a MB, or
        before reading its token ids (6M of them held every stream for 0.75 s). truncating: the
        request keeps only its last tokens (sampling.truncate_prompt_tokens), so a longer input may
        fit; the message size the router reads still bounds it (max_request_bytes). Then token ids
        count as characters (many are read on a thread)."""
        kind = req.WhichOneof("input")
        if truncating:
            return (
                len(req.token_ids.ids)
                if kind == "token_ids"
                else len(req.prompt)
                if kind == "prompt"
                else sum(len(m.content) + len(m.role) for m in req.messages.messages)
            )
        if kind == "token_ids":
            if (n := len(req.token_ids.ids)) >= self.context:
                raise InvalidRequestError(
                    "token_ids", f"is {n} tokens; the context length is {self.context}, prompt and completion together"
                )
            return 0
        if kind == "prompt":
            n = len(req.prompt)
        elif kind == "messages":
            msgs = req.messages.messages
            if len(msgs) > self.context:  # a chat template gives a message at least one token
                raise InvalidRequestError(
                    "messages", f"{len(msgs)} messages cannot fit the context length {self.context}"
                )
            n = sum(len(m.content) + len(m.role) for m in msgs)
        else:
            return 0
        most = self.context * (self.tokenizer.max_token_chars or 0) if self.tokenizer else 0
        if most and n > most:
            raise InvalidRequestError(
                kind,
                f"is {n} characters: at least {-(-n // self.tokenizer.max_token_chars)} "
                f"tokens, and the context length is {self.context}",
            )
        return n

    def prompt_ids(self, req: gen_pb.GenerateRequest) -> list[int]:
        kind, value = convert.input_of(req)
        if kind == "token_ids":
            check_vocab("token_ids", value, self.vocab)
            return value
        if self.tokenizer is None:
            raise InvalidRequestError(kind, "this model has no tokenizer; send token_ids")
        ids = self.tokenizer.encode_chat(value) if kind == "messages" else self.tokenizer.encode(value)
        if not ids:
            raise InvalidRequestError(kind, "tokenizes to nothing")
        return ids


class FrontendChecks:
    """RouterServicer's validation part: a request checked against the model, the tokenizer and its
    own sampling before admission. State: the servicer's."""

    async def _validate(self, request: gen_pb.GenerateRequest) -> tuple[str, list[int], SamplingParams, Sent]:
        convert.check_request_id(request.request_id)
        self.front.check_model(request.model)
        convert.check_cache_salt(request.cache_salt)
        params = convert.sampling_from_pb(request.sampling, self.s.default_max_tokens)
        keep = request.sampling.truncate_prompt_tokens if request.sampling.HasField("truncate_prompt_tokens") else None
        if keep is not None and keep < 1:
            raise InvalidRequestError("sampling.truncate_prompt_tokens", f"must be >= 1, got {keep}")
        if self.front.check_input_size(request, keep is not None) > INLINE_TOKENIZE_CHARS:  # beside the loop
            ids = await asyncio.to_thread(self.front.prompt_ids, request)
        else:
            ids = self.front.prompt_ids(request)
        if keep is not None:
            ids = ids[-keep:]
        check_context(len(ids), params, self.front.context, request.WhichOneof("input"))
        have = self._continuation(request, params)
        if have.count() and params.prompt_logprobs is not None:  # they came with its first token
            params = dataclasses.replace(params, prompt_logprobs=None)
        check_vocab("sampling.stop_token_ids", params.stop_token_ids, self.front.vocab)  # (as the engine does)
        check_vocab("sampling.logit_bias", (t for t, _ in params.logit_bias), self.front.vocab)
        fmt = params.structured_output
        if fmt is not None:
            if self.front.grammars is None:
                raise InvalidRequestError(fmt.field, "needs a model with a tokenizer")
            await asyncio.to_thread(self.front.grammars.check, fmt)  # ~1 ms to compile, more for a large schema
            if have.count():
                await asyncio.to_thread(self._check_follows, request.resume_from, fmt)
        return request.request_id or uuid.uuid4().hex, ids, params, have

    def _check_follows(self, c: gen_pb.Continuation, fmt) -> None:
        """The tokens a client sent again to go on (resume_from) follow the request's format, or the
        request is refused here, naming them, rather than by the worker that would prefill it."""
        carried = (
            [("resume_from.token_ids", c.token_ids)]
            if c.token_ids
            else [
                (f"resume_from.samples[{k}].token_ids", s.token_ids) for k, s in enumerate(c.samples) if not s.finished
            ]
        )
        for field, tokens in carried:
            try:
                m = self.front.grammars.matcher(fmt, tokens)
            except ValueError as e:
                raise InvalidRequestError(field, f"these tokens {e}") from None
            if c.token_ids and m.is_stopped():  # (a sample of n > 1 so ends at once: resume_samples)
                raise InvalidRequestError(
                    field, f"these tokens complete {fmt.field}, which ends the request: none is left to generate"
                )

    def _continuation(self, request: gen_pb.GenerateRequest, params: SamplingParams) -> Sent:
        """What the client of a stream sent again to go on has (resume_from), checked: the
        completion's tokens and the characters of their text, by sample (none without it)."""
        c = request.resume_from
        if params.n == 1:
            if c.samples:
                raise InvalidRequestError(
                    "resume_from.samples", "are for sampling.n > 1; with n 1, send resume_from.token_ids and text_chars"
                )
            self._check_carried("resume_from.token_ids", c.token_ids, params)
            return Sent(c.token_ids, c.text_chars)
        if c.token_ids:
            raise InvalidRequestError(
                "resume_from.token_ids", f"sampling.n is {params.n}: send each sample's in resume_from.samples"
            )
        have = Sent([], 0)
        listed = set()
        for k, sample in enumerate(c.samples):
            field = f"resume_from.samples[{k}]"
            if sample.index >= params.n:
                raise InvalidRequestError(f"{field}.index", f"{sample.index} is not below sampling.n ({params.n})")
            if sample.index in listed:
                raise InvalidRequestError(f"{field}.index", f"sample {sample.index} is listed twice")
            listed.add(sample.index)
            # One not finished may hold max_tokens: its client had its last token, not the message of
            # its end (a first token sent ahead of its KV is followed by one); resumed, it ends at once.
            if len(sample.token_ids) > params.max_tokens:
                raise InvalidRequestError(
                    f"{field}.token_ids",
                    f"{len(sample.token_ids)} tokens: more than sampling.max_tokens ({params.max_tokens})",
                )
            if not sample.finished:
                check_vocab(f"{field}.token_ids", sample.token_ids, self.front.vocab)
            have.tokens[sample.index], have.chars[sample.index] = list(sample.token_ids), sample.text_chars
            if sample.finished:
                have.finished.add(sample.index)
        if len(have.finished) == params.n:
            raise InvalidRequestError(
                "resume_from.samples", f"all {params.n} samples finished: nothing is left to generate"
            )
        return have

    def _check_carried(self, field: str, tokens, params: SamplingParams) -> None:
        if len(tokens) >= params.max_tokens:
            raise InvalidRequestError(
                field, f"{len(tokens)} tokens: sampling.max_tokens ({params.max_tokens}) leaves none to generate"
            )
        check_vocab(field, tokens, self.front.vocab)
        # Tokens that end it leave none to generate (a complete format: _check_follows): the engine
        # that took them would refuse them too, naming its own field.
        if not tokens or len(tokens) < params.min_tokens:
            return
        if tokens[-1] in params.stop_token_ids or (not params.ignore_eos and tokens[-1] in self.front.eos):
            raise InvalidRequestError(
                field,
                f"the last, {tokens[-1]}, ends the request (an end-of-sequence or "
                "stop token): none is left to generate",
            )
        if params.stop and self.front.tokenizer is not None:
            text = self.front.tokenizer.decode(list(tokens), params.skip_special_tokens)
            if hit := next((s for s in params.stop if s in text), None):
                raise InvalidRequestError(
                    field, f"their text holds the stop string {hit!r}, which ends the request: none is left to generate"
                )

    def _genai_attributes(self, request, rid: str, ids: list[int], params: SamplingParams, resumed: int) -> dict:
        kind = request.WhichOneof("input")
        attrs = {
            "splitserve.request_id": rid,
            "gen_ai.operation.name": "chat" if kind == "messages" else "text_completion",
            "gen_ai.provider.name": "splitserve",  # (gen_ai.system, deprecated for this)
            "gen_ai.request.model": self.front.name,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.usage.input_tokens": len(ids),
        }
        if params.top_k:
            attrs["gen_ai.request.top_k"] = params.top_k
        if params.seed is not None:
            attrs["gen_ai.request.seed"] = params.seed
        if params.presence_penalty:
            attrs["gen_ai.request.presence_penalty"] = params.presence_penalty
        if params.frequency_penalty:
            attrs["gen_ai.request.frequency_penalty"] = params.frequency_penalty
        if params.repetition_penalty != 1.0:
            attrs["splitserve.request.repetition_penalty"] = params.repetition_penalty
        if params.logprobs is not None:
            attrs["splitserve.request.logprobs"] = params.logprobs
        if params.prompt_logprobs is not None:
            attrs["splitserve.request.prompt_logprobs"] = params.prompt_logprobs
        if params.structured_output is not None:
            attrs["splitserve.request.structured_output"] = params.structured_output.kind
        if params.n > 1:
            attrs["gen_ai.request.choice.count"] = params.n
        if request.priority:
            attrs["splitserve.priority"] = request.priority
        if resumed:  # a stream sent again to go on (resume_from): the tokens its client had
            attrs["splitserve.resume_from.tokens"] = resumed
        return attrs
