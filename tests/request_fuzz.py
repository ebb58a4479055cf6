"""Random GenerateRequests, valid and not, for tests of what the router answers each (seeded).

Each field is drawn among valid values, edges included; in four requests of ten one part is made
wrong: a sampling value out of its range, a bad input, request_id or cache_salt, or resume_from's
tokens. ``answer_fault`` says what is wrong with an OK answer to one (one to a request of one
sample resumed with tokens that end it, a last end-of-sequence or stop token, is wrong in itself).
``random_side_call`` draws a call of the router's other methods."""

from __future__ import annotations

import collections
import random
import re

from splitserve_proto.v1 import generation_pb2 as pb

VOCAB = 49152
EOS = 2  # the model's end-of-sequence token (<|im_end|>): resume_from tokens that end the request
NOT_FINITE = [float("nan"), float("inf"), -float("inf")]
GOOD = dict(
    max_tokens=[1, 3, 8],
    temperature=[0.0, 0.7, 1.0, 2.0, 1e-6],
    top_p=[1e-6, 0.5, 1.0],
    top_k=[1, 2, 50, 10**12],
    seed=[0, 7, 2**63 - 1],
    min_tokens=[0, 1, 3],
    ignore_eos=[True, False],
    logprobs=[0, 1, 5, 20],
    prompt_logprobs=[0, 1, 20],
    presence_penalty=[-2.0, 0.0, 1.5, 2.0],
    frequency_penalty=[-2.0, 0.0, 2.0],
    repetition_penalty=[0.5, 1.0, 1.3, 2.0],
    min_p=[0.0, 0.2, 1.0],
    include_stop_str_in_output=[True, False],
    truncate_prompt_tokens=[1, 10, 2**31 - 1],
    skip_special_tokens=[True, False],
    n=[1, 2, 3, 16],
)
BAD = dict(
    max_tokens=[-1, 0, 2**40, -(2**63)],
    temperature=[-1.0, *NOT_FINITE],
    top_p=[-0.1, 0.0, 1.1, *NOT_FINITE],
    top_k=[-1],
    seed=[-1],
    min_tokens=[-1, 100, 2**40],
    logprobs=[-1, 21, 2**31 - 1],
    prompt_logprobs=[-1, 21],
    presence_penalty=[-3.0, 3.0, *NOT_FINITE],
    frequency_penalty=[3.0, *NOT_FINITE],
    repetition_penalty=[-1.0, 0.0, 3.0, *NOT_FINITE],
    min_p=[-0.1, 1.1, *NOT_FINITE],
    truncate_prompt_tokens=[-1, 0],
    n=[-1, 0, 17],
)
TEXTS = ["hi", "The capital of France is", "\u00e9\u4e2d\U0001f600", "a\x00b", "\ud7ff", "<|im_start|>", "\n\t "]
# what INVALID_ARGUMENT's message starts with: the field, as the proto names it ("sampling.stop[2]: ...")
FIELD = re.compile(r"^[a-z_]+(\.[a-z_]+|\[\d+\])*: ")


def random_sampling(rng: random.Random, bad: bool) -> pb.SamplingParams:
    """SamplingParams, each field set or not, among valid values and edges; bad: one part wrong."""
    s = pb.SamplingParams()
    for name, values in GOOD.items():
        if rng.random() < 0.25:
            setattr(s, name, rng.choice(values))
    if rng.random() < 0.15:
        s.stop.extend(rng.choice([["a"], [".", ","], ["x" * 100], ["\n"], ["The", " the"]]))
    if rng.random() < 0.1:
        s.stop_token_ids.extend(rng.choice([[2], [0, 1, 2], [VOCAB - 1]]))
    if rng.random() < 0.1:
        for _ in range(rng.randint(1, 3)):
            s.logit_bias[rng.choice([0, 5, 330, VOCAB - 1])] = rng.choice([-100.0, 0.0, 5.0, 100.0])
    if rng.random() < 0.1:
        so = s.structured_output
        kind = rng.randint(0, 4)
        if kind == 0:
            so.regex = rng.choice(["[ab]{1,3}", "a*", "[0-9]+ apples"])
        elif kind == 1:
            so.json_schema = rng.choice(['{"type":"object"}', "{}", '{"type":"integer"}'])
        elif kind == 2:
            so.json_object = True
        elif kind == 3:
            so.choice.values.extend(rng.choice([["a", "b"], ["yes", "no", "maybe"]]))
        else:
            so.lark = rng.choice(['start: "a" | "b"', "start: /[0-9]+/"])
        if kind < 3 and rng.random() < 0.3:
            so.disable_any_whitespace = True
    if bad:
        kind = rng.randint(0, 4)
        if kind == 0:
            name = rng.choice(list(BAD))
            setattr(s, name, rng.choice(BAD[name]))
        elif kind == 1:
            s.stop.extend(rng.choice([[""], ["x" * 10000], ["."] * 200]))
        elif kind == 2:
            s.stop_token_ids.extend(rng.choice([[-1], [VOCAB], [0] * 1000, [2**62]]))
        elif kind == 3:
            s.logit_bias[rng.choice([-1, VOCAB, 2**62, 5])] = rng.choice([-101.0, 101.0, *NOT_FINITE])
        else:
            so = s.structured_output
            so.Clear()
            kind = rng.randint(0, 5)
            if kind == 0:
                so.regex = rng.choice(["(", "[z-a]"])
            elif kind == 1:
                so.json_schema = rng.choice(["not json", '{"type":"nope"}', "[]"])
            elif kind == 2:
                so.json_object = False
            elif kind == 3:
                so.choice.values.extend(rng.choice([[], [""]]))
            elif kind == 4:
                so.lark = rng.choice(["start:", "", "start: undefined_rule"])
            else:
                so.disable_any_whitespace = True
    return s


def random_request(rng: random.Random, ids: list[str]) -> pb.GenerateRequest:
    """One request; ids: the request_ids drawn so far (some are sent again)."""
    bad = rng.choice(["sampling", "input", "id", "resume", "salt"]) if rng.random() < 0.4 else None
    r = pb.GenerateRequest()
    if rng.random() < 0.5:
        r.request_id = rng.choice([f"fz-{rng.randrange(10**9)}"] * 4 + ids[-5:])
    if bad == "id":
        r.request_id = rng.choice(["x" * 129, "has space", "\u00e9", "{t}", "a\nb"])
    if r.request_id:
        ids.append(r.request_id)
    kind = rng.random()
    if kind < 0.45:
        r.prompt = rng.choice(TEXTS + ["word " * rng.randint(1, 300)])
    elif kind < 0.7:
        for _ in range(rng.randint(1, 3)):
            r.messages.messages.add(role=rng.choice(["user", "system", "assistant"]), content=rng.choice(TEXTS))
    else:
        r.token_ids.ids.extend(rng.choice([[1, 2, 3], [rng.randrange(VOCAB) for _ in range(rng.randint(1, 400))]]))
    if bad == "input":
        kind = rng.randint(0, 4)
        if kind == 0:
            r.prompt = ""
        elif kind == 1:
            r.token_ids.ids.extend(rng.choice([[-1], [VOCAB], [2**62], [5] * 9000]))
        elif kind == 2:
            r.messages.messages.add(role=rng.choice(["", "robot", "tool"]), content="hi")
        elif kind == 3:
            r.ClearField("input")
        else:
            r.messages.SetInParent()
            r.messages.ClearField("messages")
    if rng.random() < 0.9 or bad == "sampling":
        r.sampling.CopyFrom(random_sampling(rng, bad == "sampling"))
    if not r.sampling.HasField("max_tokens"):
        r.sampling.max_tokens = rng.randint(1, 12)
    if rng.random() < 0.2:
        r.priority = rng.choice([-(2**31), -1, 1, 2**31 - 1])
    if rng.random() < 0.1:
        r.cache_salt = rng.choice(["a", "\u00e9", "tenant-1"])
    if bad == "salt":
        r.cache_salt = "x" * 257
    if rng.random() < 0.08 or bad == "resume":
        c = r.resume_from
        n = r.sampling.n if r.sampling.HasField("n") else 1
        if n == 1:
            c.token_ids.extend(rng.choice([[5], [5, 6], [5, EOS]] + ([[-1], [VOCAB], [5] * 20] if bad else [])))
            c.text_chars = rng.choice([0, 1] + ([2**32 - 1] if bad else []))
        else:
            for i in range(min(n, 2)):
                c.samples.add(
                    index=rng.choice([i, 5]) if bad else i,
                    token_ids=rng.choice([[5], [6, 7], [6, EOS]]),
                    finished=rng.random() < 0.3,
                )
    return r


def answer_fault(req: pb.GenerateRequest, answer, unary: bool) -> str:
    """What is wrong with an OK answer (a GenerateResponse, or a stream's messages) to req, or ''."""
    sp = req.sampling
    n = sp.n if sp.HasField("n") else 1
    most = sp.max_tokens
    carried = list(req.resume_from.token_ids)
    if (
        carried
        and len(carried) >= sp.min_tokens
        and (carried[-1] in sp.stop_token_ids or (carried[-1] == EOS and not sp.ignore_eos))
    ):
        return f"resumed with tokens {carried} that end it: none was left to generate"
    if unary:
        outs = list(answer.choices) if n > 1 else [answer]
        want = n - sum(s.finished for s in req.resume_from.samples)  # a finished one is not sent again
        if len(outs) != want:
            return f"{len(outs)} samples, not {want}"
        for o in outs:
            if len(o.token_ids) > most or o.finish_reason not in ("length", "stop", "eos"):
                return f"sample {o.index}: {len(o.token_ids)} tokens (max_tokens {most}), {o.finish_reason!r}"
            if sp.HasField("logprobs") and len(o.logprobs) != len(o.token_ids):
                return f"sample {o.index}: {len(o.logprobs)} log probabilities for {len(o.token_ids)} tokens"
        return ""
    tokens, ends = collections.defaultdict(int), collections.Counter()
    for m in answer:
        tokens[m.index] += len(m.token_ids)
        ends[m.index] += bool(m.finish_reason)
    want = sorted(set(range(n)) - {s.index for s in req.resume_from.samples if s.finished})
    if sorted(ends) != want or set(ends.values()) != {1}:
        return f"ends {dict(ends)}, not one for each of {want}"
    if any(t > most for t in tokens.values()):
        return f"tokens {dict(tokens)} (max_tokens {most})"
    return ""


def random_side_call(rng: random.Random, ids: list[str]) -> tuple[str, object]:
    """One call of the router's other methods (method name, request), valid or not: Tokenize and
    Detokenize of random inputs, GetRequest and Abort of ids drawn so far, unknown or malformed."""
    method = rng.choice(["Tokenize", "Detokenize", "GetRequest", "Abort"])
    if method == "Tokenize":
        r = pb.TokenizeRequest()
        kind = rng.random()
        if kind < 0.5:
            r.prompt = rng.choice(TEXTS + ["", "word " * rng.randint(1, 300)])
        elif kind < 0.9:
            for _ in range(rng.randint(0, 3)):
                r.messages.messages.add(
                    role=rng.choice(["user", "system", "assistant", "", "robot"]), content=rng.choice(TEXTS)
                )
            r.messages.SetInParent()
        return method, r  # (else: no input)
    if method == "Detokenize":
        r = pb.DetokenizeRequest(
            token_ids=rng.choice(
                [[], [1, 2, 3], [rng.randrange(VOCAB) for _ in range(50)], [-1], [VOCAB], [2**62], [0] * 5000]
            )
        )
        if rng.random() < 0.5:
            r.skip_special_tokens = rng.random() < 0.5
        return method, r
    rid = rng.choice(ids[-20:] + ["", "never-sent", "x" * 129, "has space"] if ids else ["", "never-sent"])
    return method, (pb.GetRequestRequest if method == "GetRequest" else pb.AbortRequest)(request_id=rid)
