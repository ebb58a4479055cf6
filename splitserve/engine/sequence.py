"""A request's state inside the engine."""

from __future__ import annotations

import enum
import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import torch

from splitserve.engine.params import SamplingParams

_arrivals = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_len: int
    token_ids: list[int]  # prompt + generated; the last one has no KV yet once sampled
    params: SamplingParams
    generator: torch.Generator | None
    arrival: float = field(default_factory=time.monotonic)
    order: int = field(default_factory=lambda: next(_arrivals))  # admission order (preempt newest first)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_preemptions: int = 0
    prefill_only: bool = False  # prefill worker: park the KV for export after the first token
    priority: int = 0  # lower is scheduled first (continuous policy); FIFO within one value
    paused: bool = False  # its reader is behind: left out of steps, its KV kept (LLMEngine.pause_request)
    detok: object | None = None  # IncrementalDetokenizer when the engine has a tokenizer
    text: str = ""  # output text so far (stop strings are searched here)
    emitted_chars: int = 0  # how much of ``text`` has been handed out
    emitted_tokens: int = 0  # how many output tokens have been handed out
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache at admission
    num_cache_blocks: int = 0  # leading blocks filed in the prefix cache (or taken from it)
    num_shared_on_import: int = 0  # imported: tokens whose KV was already in the prefix cache (not copied in)
    cache_salt: str = ""  # the root of its prefixes: only sequences with the same salt share cached KV
    logprobs: list = field(default_factory=list)  # TokenLogprob of each output token, when params.logprobs is set
    # With params.prompt_logprobs: TokenLogprob of prompt tokens 1, 2, ... (entry i from the logits at
    # position i), as far as computed: a chunked prefill adds them chunk by chunk. Handed out with
    # the first token, and then dropped (kept by a prefill_only sequence, whose export carries them).
    prompt_logprobs: list = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # With penalties (params.penalized), made at its first sample: how often each output token is
    # there (kept up to date by the engine), and its prompt's tokens, each once.
    output_counts: Counter[int] | None = None
    prompt_ids: torch.Tensor | None = None
    cache_entry: int | str = 0  # the prefix cache's entry for the last of them (kv_cache.BlockPool), or the root
    # With params.structured_output: its llguidance matcher, fed every output token so far (structured.py).
    matcher: object | None = None
    mask_ms: deque | None = None  # with a matcher: the CPU milliseconds of its last masks (Grammars.failure)
    error: Exception | None = None  # finish_reason "error": why (an InvalidRequestError naming the field)
    # params.n > 1: the samples after the first are sequences of their own, made from the first's
    # prompt KV once its first token is sampled (LLMEngine._fork): request_id "<parent>/<index>".
    index: int = 0
    parent: str = ""  # a later sample's: the request's id ("" for the first sample)
    # Resumed (its decode worker was lost mid-stream, LLMEngine.add_request): its first `resumed`
    # output tokens, and `resumed_chars` characters of their text, its client has already
    resumed: int = 0
    resumed_chars: int = 0
    first_finish: str | None = (
        None  # prefill_only with n > 1: the reason its first token ended it (parked all the same)
    )

    def __post_init__(self) -> None:
        self.cache_entry = self.cache_root

    @property
    def cache_root(self) -> int | str:
        return self.cache_salt or 0

    @property
    def max_cached(self) -> int:
        """The most of its tokens whose KV may come from the prefix cache: all but the last (its
        logits give the next token), and, while it lacks prompt log probabilities it asked for,
        none past those it has (a cached block's KV holds no logits)."""
        n = len(self.token_ids) - 1
        if self.wants_prompt_logprobs:
            n = min(n, len(self.prompt_logprobs))
        return n

    @property
    def wants_prompt_logprobs(self) -> bool:
        """It asked for prompt log probabilities and lacks some (none were handed out yet)."""
        return (
            self.params.prompt_logprobs is not None
            and not self.prompt_logprobs_sent
            and len(self.prompt_logprobs) < self.prompt_len - 1
        )

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_pending(self) -> int:
        """Tokens still to compute before the next sample."""
        return len(self.token_ids) - self.num_computed
