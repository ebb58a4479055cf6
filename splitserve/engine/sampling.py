"""The sampler (the per-request parameters are in ``params``).

Greedy rows are decided by one ``argmax`` over the batch. Random rows each own a
``torch.Generator`` seeded from the request, so a seeded request draws the same
tokens whatever else shares its batch, and the generator state can travel with
the sequence when its KV is handed to another engine.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from splitserve.engine.outputs import TokenLogprob
from splitserve.engine.params import SamplingParams

_F32_MAX = float(torch.finfo(torch.float32).max)
# A top_p draw looks among the 256 most likely tokens first, then the 8192, and sorts the whole
# vocabulary only when the kept tokens reach past those. On SmolLM2's logits, 2 threads' host:
# top-k 256 takes 0.1 ms, 8192 1.0 ms, sorting all 49152 3.5 ms; top_p 0.95 keeps ~5000 tokens at
# temperature 1.2, and far fewer below 1.
_CANDIDATES = (256, 8192)


def new_generator(params: SamplingParams) -> torch.Generator | None:
    """A generator for a random request; None for greedy ones."""
    if params.greedy:
        return None
    g = torch.Generator()
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed)
    return g


@dataclass
class Seen:
    """What a row's penalties look at (SamplingParams.penalized): the tokens of its output so far,
    each once, with how often each is there, and (for repetition_penalty) those of its prompt."""

    output_ids: torch.Tensor  # int64 [n]
    output_counts: torch.Tensor  # float32 [n]
    prompt_ids: torch.Tensor | None = None  # int64, the prompt's tokens, each once


@dataclass
class SampleRow:
    """One row of the logits to sample from, and how."""

    params: SamplingParams
    generator: torch.Generator | None
    banned: tuple[int, ...] = field(default=())  # token ids masked out (EOS before min_tokens)
    seen: Seen | None = None  # with penalties
    matcher: object | None = None  # with structured output: its llguidance matcher, at the row's next token
    mask_ms: deque | None = None  # with a matcher: constrain() appends the CPU milliseconds its mask took


def penalize(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """Apply each row's penalties, then its logit_bias, to its row of logits, in place (vLLM's
    order: repetition, then frequency and presence), for all rows at once: one gather and one
    scatter of each kind, so a step's cost on a GPU does not grow with the rows in launches."""
    rep: list[tuple[int, torch.Tensor, float]] = []  # (row, tokens, penalty)
    sub: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (row, tokens, what to subtract)
    for i, row in enumerate(rows):
        seen, p = row.seen, row.params
        if p.logit_bias:  # added after the penalties: subtracting its negation
            ids, bias = zip(*p.logit_bias)
            sub.append((i, torch.tensor(ids, dtype=torch.int64), -torch.tensor(bias, dtype=torch.float32)))
        if seen is None:
            continue
        if p.repetition_penalty != 1.0:
            ids = seen.output_ids if seen.prompt_ids is None else torch.cat([seen.prompt_ids, seen.output_ids])
            rep.append((i, ids, p.repetition_penalty))
        if seen.output_ids.numel() and (p.frequency_penalty or p.presence_penalty):
            sub.append((i, seen.output_ids, p.frequency_penalty * seen.output_counts + p.presence_penalty))
    dev = logits.device
    if rep:
        r, t = _flat(rep, dev)
        by = torch.cat([torch.full((len(t),), x, dtype=torch.float32) for _, t, x in rep]).to(dev)
        v = logits[r, t]  # a token in both prompt and output is read once here, so penalized once
        logits[r, t] = torch.where(v > 0, v / by, v * by)
    if sub:  # a row's bias and its frequency and presence penalties add up (accumulate)
        logits.index_put_(_flat(sub, dev), -torch.cat([x for _, _, x in sub]).to(dev), accumulate=True)


def _flat(entries: list[tuple], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, tokens, ...) entries -> the (row, token) index pairs of all their tokens, on dev."""
    rows = torch.cat([torch.full((len(t),), i, dtype=torch.int64) for i, t, *_ in entries])
    return rows.to(dev), torch.cat([t for _, t, *_ in entries]).to(dev)


def constrain(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """Mask each structured row's logits, in place, to the tokens its format allows next (-inf for
    the others), and its banned tokens too unless that leaves none: the format wins over
    min_tokens (a complete format ends the sequence before it samples again, so this is a format
    that allows only EOS or a stop token here)."""
    idx = [i for i, row in enumerate(rows) if row.matcher is not None]
    if not idx:
        return
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    bits = torch.empty((len(idx), words), dtype=torch.int32)
    for j, i in enumerate(idx):  # llguidance writes each row's bits (token t: bit t % 32 of word t // 32)
        t = time.thread_time_ns()  # on this thread, which llguidance computes on: its CPU time, no waits
        rows[i].matcher.unsafe_compute_mask_ptr(bits[j].data_ptr(), words * 4)
        if rows[i].mask_ms is not None:
            rows[i].mask_ms.append((time.thread_time_ns() - t) / 1e6)
    ruled_out = ((bits.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(len(idx), -1)[:, :vocab] == 0
    for j, i in enumerate(idx):
        if ruled_out[j].all():  # an erring matcher (its limits): unmasked; the token it then refuses ends the row
            ruled_out[j] = False
        elif rows[i].banned:
            more = ruled_out[j].clone()
            more[list(rows[i].banned)] = True
            if not more.all():
                ruled_out[j] = more
    ruled_out = ruled_out.to(logits.device)
    if len(idx) == len(rows):  # in place: 32 rows in ~0.45 ms here, where indexing them copied them (~0.9 ms)
        logits.masked_fill_(ruled_out, -math.inf)
    else:
        for j, i in enumerate(idx):
            logits[i].masked_fill_(ruled_out[j], -math.inf)


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[int]:
    """Pick one token per row. logits: [len(rows), vocab], float32."""
    constrain(logits, rows)  # first: a token the format rules out stays out whatever the penalties add
    penalize(logits, rows)
    for i, row in enumerate(rows):
        if row.banned and row.matcher is None:  # (constrain() banned a structured row's)
            logits[i, list(row.banned)] = -math.inf
    out = logits.argmax(dim=-1).tolist()
    for i, row in enumerate(rows):
        if not row.params.greedy:  # on the host: the request's generator is a CPU one, and travels with its KV
            out[i] = _sample_one(logits[i].cpu(), row.params, row.generator)
    return out


def sample_with_logprobs(logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[TokenLogprob | None]]:
    """sample(), and the log probability of each token picked for a row whose request asks for them
    (None for the others): from the logits as the model gave them, before any row is masked."""
    want = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not want:
        return sample(logits, rows), [None] * len(rows)
    dist = torch.log_softmax(logits[want].float(), dim=-1)  # a copy: sample() masks rows in place
    tokens = sample(logits, rows)
    out: list[TokenLogprob | None] = [None] * len(rows)
    for i, lp in zip(want, token_logprobs(dist, [tokens[i] for i in want], [rows[i].params.logprobs for i in want])):
        out[i] = lp
    return tokens, out


def token_logprobs(dist: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    """Each row's token's entry of dist (rows of log probabilities), its rank there (ties share the
    best) and the row's ks[i] most likely, in one pass over the batch."""
    chosen = dist.gather(1, torch.tensor(tokens, device=dist.device).view(-1, 1))
    ranks = ((dist > chosen).sum(dim=1) + 1).tolist()
    k = min(max(ks), dist.shape[1])
    top_v, top_i = torch.topk(dist, k, dim=1) if k else (dist[:, :0], dist[:, :0].long())
    top_v, top_i, chosen = top_v.tolist(), top_i.tolist(), chosen.view(-1).tolist()
    return [
        TokenLogprob(int(t), lp, rank, tuple(zip(ids[:n], vals[:n])))
        for t, lp, rank, ids, vals, n in zip(tokens, chosen, ranks, top_i, top_v, ks)
    ]


def _sample_one(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """One draw from the row's distribution (temperature, then top_k, then top_p, then min_p), by inverse
    transform: one uniform from the request's own generator, so the draw depends on nothing else in
    the batch. For top_p, only the _CANDIDATES most likely are sorted while the kept tokens are among them."""
    # (logits - max) * 1/T: <= 0, the best at 0, never NaN. A 1/T beyond float32's range acts as the
    # limit, greedy (ties shared): dividing by a temperature float32 rounds to 0 drew token 0 always.
    scaled = (logits - logits.max()) * min(1.0 / p.temperature, _F32_MAX)
    u = float(torch.rand((), dtype=torch.float64, generator=gen))
    vocab = scaled.numel()
    k = p.top_k if 0 < p.top_k < vocab else vocab
    if p.top_p >= 1.0:
        if k == vocab:  # the whole vocabulary, in its own order: nothing to sort
            weights = torch.exp(scaled.double())
            if p.min_p > 0:  # the most likely weighs 1
                weights = torch.where(weights >= p.min_p, weights, 0.0)
            return _inverse(weights, u)
        values, order = torch.topk(scaled, k)
        weights = torch.exp(values.double())
        return int(order[_inverse(weights[: _min_p_prefix(weights, p.min_p, k)], u)])
    # top_p. Without top_k, the vocabulary's mass is one sum, and the candidates hold the kept
    # tokens when their prefix reaches top_p of it. With top_k, the mass is the top-k set's own.
    if k == vocab:
        total = float(torch.exp(scaled.double()).sum())
        for n in (c for c in _CANDIDATES if c < vocab):
            values, order = torch.topk(scaled, n)  # sorted, the most likely first
            weights = torch.exp(values.double())
            keep = _top_p_prefix(weights, p.top_p * total)
            if keep <= n:
                return int(order[_inverse(weights[: _min_p_prefix(weights, p.min_p, keep)], u)])
    values, order = torch.topk(scaled, k)  # the whole top-k set, sorted
    weights = torch.exp(values.double())
    keep = min(_top_p_prefix(weights, p.top_p * float(weights.sum())), k)
    return int(order[_inverse(weights[: _min_p_prefix(weights, p.min_p, keep)], u)])


def _min_p_prefix(weights: torch.Tensor, min_p: float, keep: int) -> int:
    """Of the first `keep` of weights (sorted, largest first, the first 1: the most likely's),
    how many min_p leaves (those at least min_p): at least 1."""
    if min_p <= 0:
        return keep
    return max(1, min(keep, int((weights[:keep] >= min_p).sum())))


def _top_p_prefix(weights: torch.Tensor, reach: float) -> int:
    """How many of weights (sorted, largest first) the smallest prefix whose sum reaches `reach`
    holds (at least 1): more than weights holds when they do not reach it."""
    return int(torch.searchsorted(torch.cumsum(weights, 0), reach)) + 1


def _inverse(weights: torch.Tensor, u: float) -> int:
    """The index i where u * sum(weights) falls in the running sums: i with probability
    weights[i] / sum(weights). A weight of 0 is never drawn."""
    cum = torch.cumsum(weights, 0)
    i = int(torch.searchsorted(cum, u * float(cum[-1]), right=True))
    return min(i, weights.numel() - 1)
