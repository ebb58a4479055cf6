"""What the engine hands back: per-request outputs and per-step statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

FINISH_LENGTH = "length"
FINISH_STOP = "stop"
FINISH_EOS = "eos"
FINISH_CANCELLED = "cancelled"
FINISH_ERROR = "error"
FINISH_PREFILLED = "prefilled"  # prefill_only request parked with its KV, waiting for export
SAMPLE_SEP = "/"  # a request's sample i > 0 runs here as <request id>/<i> (params.n > 1)


def sample_key(request_id: str, index: int) -> str:
    """The id a request's sample runs under here: the request's own for sample 0."""
    return f"{request_id}{SAMPLE_SEP}{index}" if index else request_id


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A sampled token's log probability under the model (before temperature, top_k, top_p and
    min_tokens' masking), its rank there (1 = the most likely) and the most likely tokens at its
    position, most likely first: (token id, log probability) pairs, as many as the request asked."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


def placeholder_logprobs(token_ids) -> list[TokenLogprob]:
    """Stand-ins for the log probabilities of tokens a resumed request carries (LLMEngine.add_request's
    resumed): their own went to the client before its decode worker was lost, and these are never
    handed out; they keep the count of log probabilities equal to the count of sampled tokens."""
    return [TokenLogprob(t, 0.0, 0) for t in token_ids]


@dataclass
class RequestOutput:
    """New tokens of one request since the last step that reported it."""

    request_id: str
    new_token_ids: list[int]
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not computed)
    error: str | None = None
    exception: Exception | None = None  # with error, where the engine raised one: servers map it to a status
    new_logprobs: list[TokenLogprob] | None = None  # with params.logprobs: one per new token
    # With params.prompt_logprobs, on the output of the first token: one per prompt token after the first
    prompt_logprobs: list[TokenLogprob] | None = None
    index: int = 0  # which of the request's params.n samples (request_id is the request's for all)


@dataclass
class StepStats:
    """One engine step, for metrics (issue: per-step statistics)."""

    policy: str
    num_seqs: int = 0  # sequences that took part in the forward
    num_tokens: int = 0  # tokens computed by the forward (padding included)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_cached_tokens: int = 0  # tokens of sequences admitted this step found in the prefix cache (not computed)
    num_queried_tokens: int = 0  # tokens of sequences admitted this step looked up in the prefix cache
    padding_tokens: int = 0  # rows/positions computed for nothing (static/dynamic)
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    num_preempted: int = 0
    preempted: list[str] = field(default_factory=list)  # their request ids (a sample's: its request's)
    step_time_s: float = 0.0
    forward_time_s: float = 0.0
    sample_time_s: float = 0.0
    # CUDA: the forward's time on the device, between events recorded on its stream before and
    # after it (time the device spent on other processes' work meanwhile included); 0 elsewhere.
    # Beside step_time_s it splits a step into the device's part and the host's.
    device_time_s: float = 0.0
    graphed: bool = False  # the forward replayed captured CUDA graphs (whole, or pieces around attention)
    finished: list[str] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)  # sequences in the forward
