"""Per-request sampling parameters and the sampler.

Greedy rows are decided by one ``argmax`` over the batch. Random rows each own a
``torch.Generator`` seeded from the request, so a seeded request draws the same
tokens whatever else shares its batch, and the generator state can travel with
the sequence when its KV is handed to another engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from splitserve.engine.errors import InvalidRequestError

_MAX_SEED = 2**63 - 1
# Every stop string is looked for after every token, and the longest one's length of text is held
# back from the stream: without bounds, one request's stops slowed every request in its batch
# (350,000 stop strings in a 3.5 MB message: TPOT 14 -> 77 ms for its neighbours, stalls of 0.46 s).
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
_F32_MAX = float(torch.finfo(torch.float32).max)
# A top_p draw looks among the 256 most likely tokens first, then the 8192, and sorts the whole
# vocabulary only when the kept tokens reach past those. On SmolLM2's logits, 2 threads' host:
# top-k 256 takes 0.1 ms, 8192 1.0 ms, sorting all 49152 3.5 ms; top_p 0.95 keeps ~5000 tokens at
# temperature 1.2, and far fewer below 1.
_CANDIDATES = (256, 8192)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.max_tokens < 1:
            raise InvalidRequestError("sampling.max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("sampling.temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise InvalidRequestError("sampling.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError("sampling.top_k", f"must be >= 0, got {self.top_k}")
        if self.min_tokens < 0:
            raise InvalidRequestError("sampling.min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                "sampling.min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.seed is not None and not (0 <= self.seed <= _MAX_SEED):
            raise InvalidRequestError("sampling.seed", f"must be in [0, 2^63), got {self.seed}")
        check_stop_counts(len(self.stop), len(self.stop_token_ids))
        if any(not s for s in self.stop):
            raise InvalidRequestError("sampling.stop", "stop strings must be non-empty")
        long = next((i for i, s in enumerate(self.stop) if len(s) > MAX_STOP_CHARS), None)
        if long is not None:
            raise InvalidRequestError(f"sampling.stop[{long}]", f"must be at most {MAX_STOP_CHARS} characters, "
                                                               f"got {len(self.stop[long])}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("sampling.stop_token_ids", "token ids must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_stop_counts(stop: int, stop_token_ids: int) -> None:
    """Raise InvalidRequestError if a request has more stop strings or stop token ids than allowed
    (callers holding the protobuf count them before copying the lists)."""
    if stop > MAX_STOP_STRINGS:
        raise InvalidRequestError("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {stop}")
    if stop_token_ids > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError("sampling.stop_token_ids",
                                  f"at most {MAX_STOP_TOKEN_IDS} token ids, got {stop_token_ids}")


def check_context(prompt_len: int, params: SamplingParams, context: int, input_field: str = "prompt") -> None:
    """Raise InvalidRequestError if prompt + max_tokens exceed the context: naming the input when it
    alone leaves no room for even one token, else sampling.max_tokens."""
    if prompt_len >= context:
        raise InvalidRequestError(input_field, f"is {prompt_len} tokens; the context length is {context}, "
                                               "prompt and completion together")
    total = prompt_len + params.max_tokens
    if total > context:
        raise InvalidRequestError(
            "sampling.max_tokens",
            f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the context length "
            f"{context}",
        )


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
class SampleRow:
    """One row of the logits to sample from, and how."""

    params: SamplingParams
    generator: torch.Generator | None
    banned: tuple[int, ...] = field(default=())  # token ids masked out (EOS before min_tokens)


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[int]:
    """Pick one token per row. logits: [len(rows), vocab], float32."""
    for i, row in enumerate(rows):
        if row.banned:
            logits[i, list(row.banned)] = -math.inf
    out = logits.argmax(dim=-1).tolist()
    for i, row in enumerate(rows):
        if not row.params.greedy:  # on the host: the request's generator is a CPU one, and travels with its KV
            out[i] = _sample_one(logits[i].cpu(), row.params, row.generator)
    return out


def _sample_one(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """One draw from the row's distribution (temperature, then top_k, then top_p), by inverse
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
            return _inverse(torch.exp(scaled.double()), u)
        values, order = torch.topk(scaled, k)
        return int(order[_inverse(torch.exp(values.double()), u)])
    # top_p. Without top_k, the vocabulary's mass is one sum, and the candidates hold the kept
    # tokens when their prefix reaches top_p of it. With top_k, the mass is the top-k set's own.
    if k == vocab:
        total = float(torch.exp(scaled.double()).sum())
        for n in (c for c in _CANDIDATES if c < vocab):
            values, order = torch.topk(scaled, n)  # sorted, the most likely first
            weights = torch.exp(values.double())
            keep = _top_p_prefix(weights, p.top_p * total)
            if keep <= n:
                return int(order[_inverse(weights[:keep], u)])
    values, order = torch.topk(scaled, k)  # the whole top-k set, sorted
    weights = torch.exp(values.double())
    keep = min(_top_p_prefix(weights, p.top_p * float(weights.sum())), k)
    return int(order[_inverse(weights[:keep], u)])


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
