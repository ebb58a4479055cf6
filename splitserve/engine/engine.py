"""LLMEngine: add requests, call ``step()``, read outputs.

step = schedule -> execute -> update. The same engine runs whole in one process
(the baseline and the tests), as a prefill worker (``prefill_only`` requests park
their KV for export after the first token) and as a decode worker (``import_kv``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import Counter, deque

import torch

from splitserve.engine import cache_dir, layout_cache, native, pack_cache
from splitserve.engine.attention import AttnSeq, RaggedBatch, chunk_mask
from splitserve.engine.config import EngineConfig
from splitserve.engine.cores import CoreShare
from splitserve.engine.cuda_graphs import DecodeGraphs, GraphCaptureError, PiecewiseGraphs
from splitserve.engine.errors import (
    CapacityError,
    InvalidRequestError,
    KVImportError,
    KVPrefixMissing,
    StepFailed,
    in_halves,
)
from splitserve.engine.kv_cache import PagedKVCache
from splitserve.engine.loader import LoadedModel, load_model
from splitserve.engine.model import LlamaModel
from splitserve.engine.outputs import (
    FINISH_CANCELLED,
    FINISH_EOS,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    RequestOutput,
    StepStats,
    TokenLogprob,
    placeholder_logprobs,
)
from splitserve.engine.padded import PaddedBatcher
from splitserve.engine.params import check_context, check_vocab
from splitserve.engine.sampling import (
    SampleRow,
    SamplingParams,
    Seen,
    new_generator,
    sample_with_logprobs,
    token_logprobs,
)
from splitserve.engine.scheduler import ContinuousScheduler, SchedulerOutput
from splitserve.engine.sequence import Sequence, Status
from splitserve.engine.structured import MASK_WINDOW, Grammars
from splitserve.handoff import layout as kv_layout

FINISH_PREFILLED = "prefilled"  # prefill_only request parked with its KV, waiting for export
SAMPLE_SEP = "/"  # a request's sample i > 0 runs here as <request id>/<i> (params.n > 1)


def sample_key(request_id: str, index: int) -> str:
    """The id a request's sample runs under here: the request's own for sample 0."""
    return f"{request_id}{SAMPLE_SEP}{index}" if index else request_id


log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config
        self.num_threads = config.threads()  # read once (affinity and cgroup quota); CoreShare changes it
        torch.set_num_threads(self.num_threads)
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {config.device!r}: this torch build sees no CUDA device")
        on_cpu = self.device.type == "cpu"
        self.model = None
        self.core_share = None
        if config.core_share and on_cpu:
            # Loading computes too (the weights converted to fp32, packed and checked for GGUF
            # blocks): two workers starting side by side take half the cores each, as their
            # forwards would. With both on every core they took twice the CPU time and twice
            # as long (core_share's docstring says why).
            self.core_share = CoreShare(config.core_share, self.num_threads, self._set_threads)
        try:
            loaded = self._load(config, loaded, on_cpu)
        except BaseException:
            if self.core_share is not None:  # its slot, stamped busy, goes back now, not at exit
                self.core_share.close()
            raise
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.config.eos_with(self.tokenizer)
        shape = self.model.shape
        self.grammars = (
            None
            if self.tokenizer is None
            else Grammars(self.tokenizer, shape.vocab_size, self.eos_token_ids, config.max_mask_ms)
        )
        self.max_model_len = min(config.max_model_len or shape.max_position, shape.max_position)
        if config.fused_kernels and self.device.type == "cuda":
            from splitserve.engine import fused  # imports Triton: only where it is used

            self.model.fused = fused.load(
                shape.num_heads, shape.num_kv_heads, shape.head_dim, self.device, config.block_size, self.max_model_len
            )
        graphs = config.cuda_graphs and self.device.type == "cuda"
        continuous = config.policy == "continuous"
        self.cache = PagedKVCache(
            shape,
            config.kv_cache_bytes,
            config.block_size,
            self.device,
            spare_block=graphs and continuous,
            prefix_caching=config.prefix_caching and continuous,
        )
        self.scheduler = ContinuousScheduler(self.cache.pool, config.max_num_seqs, config.max_num_batched_tokens)
        self.padded = None if continuous else PaddedBatcher(self.model, config, graphs)
        self.graphs = self.pieces = None  # CUDA graphs: pure decode steps whole, other steps piecewise
        if graphs and continuous:
            self.graphs = DecodeGraphs(self.model, self.cache, config.max_num_seqs)
            self.pieces = PiecewiseGraphs(self.model, self.cache, config.max_num_batched_tokens)
        self.seqs: dict[str, Sequence] = {}
        self.parked: dict[str, Sequence] = {}  # prefill_only sequences holding KV for export
        self.children: dict[str, list[str]] = {}  # params.n > 1: a request's id -> its later samples' (running)
        self.last_shared_on_import = 0  # the last import_kv's Sequence.num_shared_on_import
        self.last_stats = StepStats(policy=config.policy)

    def _load(self, config: EngineConfig, loaded: LoadedModel | None, on_cpu: bool) -> LoadedModel:
        """Load the weights (unless given), build the model and its CPU kernels' packed weights,
        marking this engine busy on its core-share board meanwhile."""
        tick = self.core_share.tick if self.core_share is not None else None
        if tick:
            tick()
        loaded = loaded or load_model(config.model)
        if tick:
            tick()
        waiting = self.core_share.idle if self.core_share is not None else None  # another process makes an entry
        # the weights in the model's layout: the first engine's on them in this process, or from the disk cache
        cached = bool(loaded.layout_entry) and on_cpu and not loaded.laid_out
        with cache_dir.making(loaded.layout_entry, waiting) if cached else contextlib.nullcontext():
            laid = loaded.laid_out or (layout_cache.read(loaded.layout_entry) if cached else None)
            self.model = LlamaModel(loaded, laid)
            if on_cpu and not loaded.laid_out:  # (on a GPU, the host's copy would be kept for nothing)
                loaded.laid_out = self.model.laid_out()
                if cached and self.model.made_layout and laid is None:  # made here: kept for later processes
                    layout_cache.write(loaded.layout_entry, loaded.laid_out)
                    log.info("weights laid out for the model, kept at %s", loaded.layout_entry)
                elif laid is not None and self.model.made_layout:
                    log.warning("weights laid out at %s did not fit the model: made again", loaded.layout_entry)
        if config.attention_backend == "native" and on_cpu:
            lib = native.load_paged_attention(config.model.cache_dir)
            if lib is not None:
                self.model.attn_kernel = native.PagedAttention(lib, self.num_threads)
        if config.small_gemm and on_cpu:
            lib = native.load_small_gemm(config.model.cache_dir)
            if lib is not None:
                # the first engine on these weights in this process: their blocks from the disk cache
                first = bool(loaded.pack_entry) and not loaded.packed
                with cache_dir.making(loaded.pack_entry, waiting) if first else contextlib.nullcontext():
                    known = pack_cache.read(loaded.pack_entry) if first else None
                    t = time.perf_counter()
                    self.model.use_small_gemm(
                        native.SmallGemm(lib, self.num_threads), between=tick, cache=loaded.packed, known=known
                    )
                    if first and known is None:  # fitted here: kept for later processes
                        pack_cache.write(loaded.pack_entry, loaded.packed)
                        log.info(
                            "small-GEMM weights packed in %.1f s, kept at %s",
                            time.perf_counter() - t,
                            loaded.pack_entry,
                        )
        if config.batch_invariant:
            if self.model.attn_kernel is None or self.model.small_gemm is None:
                raise RuntimeError(
                    "batch_invariant needs the CPU kernels (paged attention and small GEMM: AVX2 and "
                    "a C compiler), which could not be built here"
                )
            self.model.invariant = True
        self.model.to(self.device)
        if tick:
            self.model.on_layer = tick
            self.core_share.idle()
        return loaded

    def drop_graphs(self, error: Exception) -> None:
        """Run every later step eagerly, with torch's ops (a capture failed on this device)."""
        log.warning("%s; running every step eagerly, unfused, from now on", error)
        self.graphs = self.pieces = None
        self.model.fused = None
        if self.padded is not None:
            self.padded.graphs = None

    def _set_threads(self, n: int) -> None:
        """Threads for this engine's next ops (called on the thread that runs the forward)."""
        self.num_threads = n
        torch.set_num_threads(n)
        for kernel in (self.model.attn_kernel, self.model.small_gemm) if self.model is not None else ():
            if kernel is not None:
                kernel.num_threads = n

    # -- requests ---------------------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        return self.model.fingerprint

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, prefill_only: bool = False) -> None:
        """Raise InvalidRequestError naming the field if this request can never run here.

        prefill_only: only the prompt and its first token need room in this engine's KV cache.
        """
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        vocab = self.model.shape.vocab_size
        check_vocab("token_ids", prompt_token_ids, vocab)
        check_context(len(prompt_token_ids), params, self.max_model_len)
        total = len(prompt_token_ids) + params.max_tokens
        if prefill_only and not self.fits(len(prompt_token_ids) + 1):
            raise InvalidRequestError(
                "prompt",
                f"{len(prompt_token_ids)} tokens can never fit in this prefill engine's KV cache "
                f"({self.kv_capacity_tokens} tokens)",
            )
        if not prefill_only and not self.fits(total):
            raise InvalidRequestError(
                "sampling.max_tokens",
                f"{total} tokens can never fit in this engine's KV cache ({self.kv_capacity_tokens} tokens)",
            )
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("sampling.stop", "stop strings need a model with a tokenizer")
        # (the sampler indexes the logits with them: one out of range failed the step of every sequence)
        check_vocab("sampling.stop_token_ids", params.stop_token_ids, vocab)
        if params.logit_bias and params.logit_bias[-1][0] >= vocab:  # sorted by id
            raise InvalidRequestError(
                "sampling.logit_bias", f"token id {params.logit_bias[-1][0]} is outside the vocabulary [0, {vocab})"
            )
        if params.n > 1 and not prefill_only:
            if self.padded is not None:
                raise InvalidRequestError(
                    "sampling.n", f"n > 1 needs the continuous policy; this engine batches {self.config.policy}"
                )
            pool = self.cache.pool  # the later samples share the prompt's whole blocks but the last
            each = pool.blocks_for(total) - (len(prompt_token_ids) - 1) // pool.block_size
            if pool.blocks_for(total) + (params.n - 1) * each > pool.num_blocks:
                raise InvalidRequestError(
                    "sampling.n",
                    f"{params.n} samples of {total} tokens can never fit in this "
                    f"engine's KV cache ({self.kv_capacity_tokens} tokens)",
                )
        if params.prompt_logprobs is not None and self.padded is not None:
            raise InvalidRequestError(
                "sampling.prompt_logprobs", f"needs the continuous policy; this engine batches {self.config.policy}"
            )
        if params.structured_output is not None:
            if self.grammars is None:
                raise InvalidRequestError(params.structured_output.field, "needs a model with a tokenizer")
            self.grammars.check(params.structured_output)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.cache.pool.num_blocks * self.cache.block_size

    def fits(self, num_tokens: int) -> bool:
        """Whether a sequence of num_tokens can ever hold its KV here (the whole pool to itself)."""
        return self.cache.pool.blocks_for(num_tokens) <= self.cache.pool.num_blocks

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        priority: int = 0,
        cache_salt: str = "",
        resumed: int = 0,
        resumed_chars: int = 0,
    ) -> None:
        """cache_salt: this request shares cached prefixes only with those of the same salt.

        resumed: the last this many of prompt_token_ids are output tokens its client has already,
        with resumed_chars characters of their text (a request whose decode worker was lost
        mid-stream, resumed elsewhere): the prompt is the rest; max_tokens, min_tokens, stop strings
        and a format go on counting from those tokens, which are not handed out again. A seeded
        sampler goes on where it was: each sampled token took one draw from the request's
        generator (sampling._sample_one), so as many are skipped. Tokens that already end it
        (max_tokens of them, a last one that stops it) are refused: nothing is left to generate.
        """
        self._check_new(request_id, cache_salt)
        self._add(request_id, prompt_token_ids, params, prefill_only, priority, cache_salt, resumed, resumed_chars)

    def resume_samples(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        samples: list[tuple[int, list[int], int]],
        *,
        priority: int = 0,
        cache_salt: str = "",
    ) -> list[RequestOutput]:
        """A request of params.n > 1 samples resumed here (its decode worker was lost mid-stream):
        samples holds (index, output tokens its client has, characters of their text) for each of
        its samples not finished yet; a finished one is not run again. Each goes on as the sample it
        was (index i > 0 as <id>/<i>, seeded seed + i: _fork), as add_request's `resumed` does for
        one: its own tokens are prefilled after the prompt and not handed out again. Outputs carry
        their sample's index; the stream of the request ends with the last of these. None carries
        the prompt's log probabilities: its client had them with sample 0's first token, which
        comes before any other sample's (_fork).

        A sample whose tokens already end it (max_tokens of them, or a last one that stops it: its
        client had that token, not yet the message of its end, which a first token sent ahead of
        its KV is followed by) is not run: its last output, returned, ends it at once."""
        self._check_new(request_id, cache_salt)
        indexes = [i for i, _, _ in samples]
        if (
            params.n < 2
            or not samples
            or len(set(indexes)) != len(indexes)
            or not all(0 <= i < params.n for i in indexes)
        ):
            raise InvalidRequestError(
                "resumed_samples", f"samples {indexes} of a request of n={params.n}: not a request that can resume so"
            )
        self.validate(prompt_token_ids, params)
        kids, ended = [], []
        try:
            for i, tokens, chars in sorted(samples, key=lambda s: s[0]):
                key = sample_key(request_id, i)
                self._add(
                    key,
                    list(prompt_token_ids) + list(tokens),
                    _sample_params(params, i),
                    False,
                    priority,
                    cache_salt,
                    len(tokens),
                    chars,
                    field="resumed_samples",
                )
                seq = self.seqs[key]
                seq.index, seq.parent = i, request_id if i else ""
                if tokens and (end := self._ends(seq, tokens[-1]))[0] is not None:
                    ended.append((seq, *end))
                elif i:
                    kids.append(key)
        except BaseException:
            for i, _, _ in samples:  # none of it stays: the request is refused whole
                if (seq := self.seqs.get(sample_key(request_id, i))) is not None:
                    self._finish(seq, FINISH_CANCELLED)
            raise
        if kids:
            self.children[request_id] = kids
        outputs = []
        for seq, reason, flush in ended:
            self._finish(seq, reason, flush)
            # The text of tokens that end it is whole with what its end flushed (a last token's
            # bytes short of a character), which its client may have too.
            seq.emitted_chars = max(seq.emitted_chars, min(seq.resumed_chars, len(seq.text)))
            outputs.append(self._output(seq))
        return outputs

    def _check_new(self, request_id: str, cache_salt: str) -> None:
        if not isinstance(cache_salt, str):  # an int would pass for a prefix cache entry
            raise InvalidRequestError("cache_salt", f"must be a string, got {type(cache_salt).__name__}")
        if request_id in self.seqs or request_id in self.parked:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in this engine")
        if SAMPLE_SEP in request_id:  # a request's later samples run under <id>/<index> (_fork)
            raise InvalidRequestError("request_id", f"must not hold {SAMPLE_SEP!r}, got {request_id!r}")

    def _add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefill_only: bool,
        priority: int,
        cache_salt: str,
        resumed: int,
        resumed_chars: int,
        field: str = "resumed",
    ) -> None:
        prefill_only = prefill_only and self.padded is None
        prompt_len = len(prompt_token_ids) - resumed
        if resumed and (resumed < 0 or prompt_len < 1 or resumed_chars < 0 or params.n > 1):
            raise InvalidRequestError(
                field,
                f"{resumed} of {len(prompt_token_ids)} tokens (n={params.n}, "
                f"{resumed_chars} characters): not a request that can resume",
            )
        self.validate(prompt_token_ids[:prompt_len], params, prefill_only)
        matcher = None
        if resumed:
            check_vocab(field, prompt_token_ids[prompt_len:], self.model.shape.vocab_size)
            if prefill_only and not self.fits(len(prompt_token_ids) + 1):
                raise InvalidRequestError(
                    "prompt",
                    f"{len(prompt_token_ids)} tokens can never fit in this prefill "
                    f"engine's KV cache ({self.kv_capacity_tokens} tokens)",
                )
            if params.structured_output is not None:
                try:
                    matcher = self.grammars.matcher(params.structured_output, prompt_token_ids[prompt_len:])
                except ValueError as e:
                    raise InvalidRequestError(
                        params.structured_output.field, f"the tokens generated so far {e}"
                    ) from None
        seq = self._new_seq(
            request_id, list(prompt_token_ids), prompt_len, params, cache_salt=cache_salt, matcher=matcher
        )
        if resumed:
            seq.resumed, seq.resumed_chars = resumed, resumed_chars
            self._resume(seq)
            if seq.generator is not None and params.seed is not None:
                for _ in range(resumed):  # one at a time, as they were drawn
                    torch.rand((), dtype=torch.float64, generator=seq.generator)
            if params.logprobs is not None:
                seq.logprobs = placeholder_logprobs(seq.output_ids)
            # One sample's tokens that end it: nothing is left to generate (resume_samples ends
            # such a sample at once: its client may have had a first token sent ahead of its KV).
            if field == "resumed" and (reason := self._ends(seq, prompt_token_ids[-1])[0]) is not None:
                del self.seqs[request_id]
                raise InvalidRequestError(
                    field,
                    f"the {resumed} tokens its client has end it ({reason}"
                    f"{'' if seq.error is None else f': {seq.error}'}): nothing "
                    "is left to generate",
                )
        seq.prefill_only = prefill_only
        seq.priority = priority
        if self.padded is not None:
            self.padded.add(seq)
        else:
            self.scheduler.add(seq)

    def _new_seq(
        self, request_id, token_ids, prompt_len, params, generator=None, cache_salt="", matcher=None
    ) -> Sequence:
        if params.structured_output is not None and matcher is None:
            matcher = self.grammars.matcher(params.structured_output)
        seq = Sequence(
            request_id=request_id,
            prompt_len=prompt_len,
            token_ids=token_ids,
            params=params,
            generator=generator if generator is not None else new_generator(params),
            cache_salt=cache_salt,
            matcher=matcher,
            mask_ms=deque(maxlen=MASK_WINDOW) if matcher is not None else None,
        )
        if self.tokenizer is not None:
            seq.detok = self.tokenizer.detokenizer(token_ids[:prompt_len], params.skip_special_tokens)
        self.seqs[request_id] = seq
        return seq

    @staticmethod
    def _resume(seq: Sequence) -> None:
        """Its output's text made again; what its client has already is not handed out again."""
        if seq.detok is not None:
            for tok in seq.output_ids:
                seq.text += seq.detok.push(tok)
        seq.emitted_tokens = seq.resumed
        seq.emitted_chars = min(seq.resumed_chars, len(seq.text))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Cancel a request wherever it is, all its samples; its KV blocks are freed at once. The
        first sample's output (None when it had ended)."""
        for key in self.children.pop(request_id, ()):
            if (child := self.seqs.get(key)) is not None:
                self._finish(child, FINISH_CANCELLED)
        seq = self.seqs.get(request_id)
        if seq is None:
            self.release(request_id)
            return None
        self._finish(seq, FINISH_CANCELLED)
        return self._output(seq)

    def fail_all(self, error: Exception) -> list[RequestOutput]:
        """End every sequence held but the parked ones "error" for this reason: after a step that
        raised (its scheduling, or a captured decode step of the static or dynamic policy; the
        policies' steps find the sequences that fail them: _isolate, PaddedBatcher._forward,
        sample_rows); their outputs."""
        outputs = []
        for seq in list(self.seqs.values()):  # (_fail drops only its own sequence)
            self._fail(seq, error)
            if (out := self._output(seq)) is not None:
                outputs.append(out)
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running) + (self.padded.num_running if self.padded else 0)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + (self.padded.num_waiting if self.padded else 0)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to compute for the sequences held (waiting or running): the work in hand."""
        return sum(seq.num_pending for seq in self.seqs.values())

    # -- the step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        if self.core_share is not None:
            self.core_share.tick()
        if self.padded is not None:
            outputs = self.padded.step(self)
            self.last_stats = self.padded.last_stats
        else:
            sched = self.scheduler.schedule()
            stats = StepStats(
                policy="continuous",
                num_preempted=len(sched.preempted),
                preempted=[s.parent or s.request_id for s in sched.preempted],
                num_cached_tokens=sched.num_cached_tokens,
            )
            outputs = self._run(sched, stats) if sched.scheduled else []
            self.last_stats = stats
        s = self.last_stats
        s.num_running, s.num_waiting = self.num_running, self.num_waiting
        s.kv_blocks_used, s.kv_blocks_free = self.cache.pool.num_used, self.cache.pool.num_free
        s.step_time_s = time.perf_counter() - t0
        if self.core_share is not None and not self.has_unfinished():
            self.core_share.idle()
        return outputs

    def _run(self, sched: SchedulerOutput, stats: StepStats) -> list[RequestOutput]:
        before = _Before([s.seq for s in sched.scheduled if s.samples])
        try:
            computed = self._compute(sched, stats)
        except Exception as e:  # noqa: BLE001 - one sequence's fault must not end its batch's
            if len(sched.scheduled) > 1:
                log.warning(
                    "an engine step of %d sequences failed (%s: %s); running it again in parts to find "
                    "the sequences that fail it",
                    len(sched.scheduled),
                    type(e).__name__,
                    e,
                )
            return self._isolate(sched.scheduled, stats, before, e)
        return self._advance(sched, *computed, stats)

    def _isolate(self, scheduled: list, stats: StepStats, before: _Before, error: Exception) -> list[RequestOutput]:
        """The step of `scheduled` raised `error`: it is run again in halves (in_halves), each run
        undoing first what a failed one did (before.restore), down to the sequences that raise
        alone. Those end "error" (StepFailed); the others go on as if nothing had failed (the KV a
        failed run wrote is written again by the next)."""

        def run(a: int, b: int) -> tuple:
            before.restore([s.seq for s in scheduled[a:b]])
            sub = SchedulerOutput(scheduled[a:b])
            return sub, self._compute(sub, stats)

        def alone(i: int, e: Exception) -> list[RequestOutput]:
            seq = scheduled[i].seq
            before.restore([seq])
            log.error(
                "request %s fails an engine step alone: it ends with an error", seq.parent or seq.request_id, exc_info=e
            )
            self._fail(seq, StepFailed(e))
            out = self._output(seq)
            return [out] if out is not None else []

        parts = in_halves(0, len(scheduled), error, run, lambda got: self._advance(got[0], *got[1], stats), alone)
        return [out for outs in parts for out in outs]

    def _compute(self, sched: SchedulerOutput, stats: StepStats) -> tuple[list, list[int], list]:
        """The forward and sampling of a step: (the scheduled that sample, their tokens, their log
        probabilities). Changes nothing but the KV of the positions computed, the generators of the
        rows that sample (_Before) and the prompt log probabilities of the rows that want them."""
        prompt_rows = _prompt_rows(sched)
        whole = not prompt_rows and self.graphs is not None and self.graphs.covers(sched.scheduled)
        batch = None if whole else self._build_batch(sched, prompt_rows)
        stats.graphed = whole or (self.pieces is not None and self.pieces.covers(batch.num_tokens))
        events = _device_events(self.device)
        t = time.perf_counter()
        try:
            if whole:
                logits = self.graphs.run([s.seq for s in sched.scheduled])
            elif stats.graphed:
                logits = self.pieces.run(batch)
        except GraphCaptureError as e:  # captures write nothing the step needs: run it eagerly instead
            self.drop_graphs(e)
            stats.graphed = False
            batch = batch or self._build_batch(sched, prompt_rows)
        if not stats.graphed:
            logits = self.model.forward(batch, self.cache.kv)
        if events:
            events[1].record()
        stats.forward_time_s += time.perf_counter() - t
        samplers = [s for s in sched.scheduled if s.samples]
        t = time.perf_counter()
        if prompt_rows:  # hidden states: the samplers' rows, then theirs
            _add_prompt_logprobs(prompt_rows, logits[len(samplers) :], self.model.lm_head_of)
            logits = self.model.lm_head_of(logits[: len(samplers)])
        tokens, logprobs = sample_with_logprobs(logits, [self._sample_row(s.seq) for s in samplers])
        stats.sample_time_s += time.perf_counter() - t
        if events:  # done when sampling read the logits back; a step that sampled nothing waits here
            events[1].synchronize()
            stats.device_time_s += events[0].elapsed_time(events[1]) / 1000
        return samplers, tokens, logprobs

    def _advance(
        self, sched: SchedulerOutput, samplers: list, tokens: list[int], logprobs: list, stats: StepStats
    ) -> list[RequestOutput]:
        """After _compute: the positions computed count, and each sampled token is taken. A
        sequence whose token fails to be taken ends "error" (StepFailed); the others go on."""
        stats.num_seqs += len(sched.scheduled)
        stats.request_ids += [s.seq.request_id for s in sched.scheduled]
        stats.num_tokens += sched.num_tokens
        for s in sched.scheduled:
            if s.seq.num_computed == len(s.seq.token_ids) - 1 and s.num_tokens == 1:
                stats.num_decode_tokens += 1
            else:
                stats.num_prefill_tokens += s.num_tokens
            s.seq.num_computed += s.num_tokens
            self.scheduler.cache_computed(s.seq)
        outputs = []
        for s, tok, lp in zip(samplers, tokens, logprobs):
            self.take(s.seq, tok, lp)
            out = self._output(s.seq)
            if out is not None:
                outputs.append(out)
            if s.seq.status is Status.FINISHED:
                stats.finished.append(s.seq.request_id)
        return outputs

    def _build_batch(
        self, sched: SchedulerOutput, prompt_rows: list[tuple[Sequence, int, int, int]] = ()
    ) -> RaggedBatch:
        """prompt_rows (_prompt_rows): rows whose logits are wanted after the samplers'."""
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slot_mapping: list[torch.Tensor] = []
        ctx_slots: list[torch.Tensor] = []
        ctx_info: list[tuple[int, int, int, int]] = []
        dec_rows: list[int] = []  # torch backend: single-token decodes, batched
        dec_slots: list[torch.Tensor] = []
        logits_rows: list[int] = []
        seqs: list[AttnSeq] = []
        kernel = self.model.attn_kernel is not None
        fused = self.model.fused is not None  # fused kernels: decodes read through their block tables
        dec_tables: list[list[int]] = []
        dev = self.device
        ctx_off = 0
        for s in sched.scheduled:
            seq, n = s.seq, s.num_tokens
            start, end = seq.num_computed, seq.num_computed + n
            q_start = len(ids)
            ids.extend(seq.token_ids[start:end])
            positions.append(torch.arange(start, end))
            if start == 0 and not self.config.batch_invariant:  # (invariant: through the kernel, as any chunk)
                slot_mapping.append(self.cache.slots(seq.block_table, 0, end))
                seqs.append(AttnSeq(q_start, n, end, -1, None))
            else:
                slots = self.cache.slots(seq.block_table, 0, end)
                slot_mapping.append(slots[start:])
                if n == 1 and not kernel:
                    dec_rows.append(q_start)
                    if fused:
                        dec_tables.append(seq.block_table)
                    else:
                        dec_slots.append(slots)
                else:
                    ctx_slots.append(slots)
                    mask = None if kernel else chunk_mask(n, end).to(dev)
                    seqs.append(AttnSeq(q_start, n, end, ctx_off, mask))
                    ctx_info.append((q_start, n, end, ctx_off))
                    ctx_off += end
            if s.samples:
                logits_rows.append(len(ids) - 1)
        for _, _, n, row in prompt_rows:
            logits_rows.extend(range(row, row + n))
        batch = RaggedBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64).to(dev),
            positions=torch.cat(positions).to(dev),
            slot_mapping=torch.cat(slot_mapping).to(dev),
            logits_rows=torch.tensor(logits_rows, dtype=torch.int64).to(dev),
            seqs=seqs,
            ctx_slots=torch.cat(ctx_slots).to(dev) if ctx_slots else None,
            ctx_info=torch.tensor(ctx_info, dtype=torch.int64) if ctx_info else None,
            hidden_out=bool(prompt_rows),
        )
        if dec_rows:
            batch.dec_rows = torch.tensor(dec_rows, dtype=torch.int64).to(dev)
        if dec_tables:
            blocks = max(len(t) for t in dec_tables)
            batch.dec_tables = torch.tensor([t + [0] * (blocks - len(t)) for t in dec_tables], dtype=torch.int64).to(
                dev
            )
            batch.dec_lens = batch.positions.index_select(0, batch.dec_rows) + 1
            batch.block_size = self.cache.block_size
        elif dec_rows:
            lens = torch.tensor([len(t) for t in dec_slots])
            padded = torch.nn.utils.rnn.pad_sequence(dec_slots, batch_first=True)  # [S, longest], 0-padded
            batch.dec_slots = padded.to(dev)
            batch.dec_mask = (torch.arange(padded.shape[1]) < lens.unsqueeze(1)).view(len(dec_rows), 1, 1, -1).to(dev)
        return batch

    # -- after sampling ---------------------------------------------------------------------

    def _sample_row(self, seq: Sequence) -> SampleRow:
        banned: tuple[int, ...] = ()
        if seq.num_output < seq.params.min_tokens:
            banned = seq.params.stop_token_ids
            if not seq.params.ignore_eos:
                banned += tuple(self.eos_token_ids)
        return SampleRow(
            seq.params, seq.generator, banned, _seen(seq) if seq.params.penalized else None, seq.matcher, seq.mask_ms
        )

    def sample_rows(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list, list[Sequence]]:
        """Sample row i of logits for seqs[i] (the static and dynamic policies' step, whose forward
        is one rectangle): ([(seq, token, log probability)], the sequences that failed). If the
        batch's sampling raises, each row is sampled alone, its generator put back first; a row
        that raises alone ends "error" (StepFailed), and the others get what the batch would have
        given them."""
        before = _Before(seqs)
        try:
            tokens, logprobs = sample_with_logprobs(logits, [self._sample_row(seq) for seq in seqs])
            return list(zip(seqs, tokens, logprobs)), []
        except Exception as e:  # noqa: BLE001 - one sequence's fault must not end its batch's
            if len(seqs) > 1:
                log.warning("sampling %d rows failed (%s: %s); sampling each alone", len(seqs), type(e).__name__, e)
        before.restore(seqs)
        taken, failed = [], []
        for i, seq in enumerate(seqs):
            try:
                (tok,), (lp,) = sample_with_logprobs(logits[i : i + 1], [self._sample_row(seq)])
            except Exception as e:  # noqa: BLE001 - its own sequence's fault
                log.error(
                    "request %s fails its sampling alone: it ends with an error",
                    seq.parent or seq.request_id,
                    exc_info=e,
                )
                self._fail(seq, StepFailed(e))
                failed.append(seq)
            else:
                taken.append((seq, tok, lp))
        return taken, failed

    def take(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        """append_token, for a token sampled in a step: one that cannot be taken ends its own
        sequence "error" (StepFailed), not the step."""
        try:
            self.append_token(seq, token, logprob)
        except Exception as e:  # noqa: BLE001 - its own sequence's fault
            log.error(
                "request %s: its token %d was not taken: it ends with an error",
                seq.parent or seq.request_id,
                token,
                exc_info=e,
            )
            if seq.request_id in self.seqs:
                self._fail(seq, StepFailed(e))

    def append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None) -> None:
        """Add a sampled token (and its log probability, when the request asks) to seq and finish it
        if a stop condition holds. A sequence held to a format that failed while its mask was made
        (Grammars.failure) ends "error" instead, without the token, which the format did not rule."""
        if (
            seq.matcher is not None
            and (err := self.grammars.failure(seq.params.structured_output, seq.matcher, seq.mask_ms)) is not None
        ):
            self._fail(seq, err)
            return
        seq.token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        if seq.output_counts is not None:
            seq.output_counts[token] += 1
        p = seq.params
        if seq.detok is not None:
            seq.text += seq.detok.push(token)
        fork = p.n > 1 and seq.index == 0 and seq.num_output == 1  # its first token: the other samples start now
        if seq.matcher is not None and not seq.matcher.consume_token(token):  # masked out: cannot happen
            log.error(
                "request %s: token %d does not follow its structured output: %s",
                seq.request_id,
                token,
                seq.matcher.get_error(),
            )
        reason, flush = self._ends(seq, token)
        if fork and seq.prefill_only:  # the KV goes to the decode worker, which makes the others from it
            seq.first_finish = reason
            self._park(seq)
            return
        if fork:
            self._fork(seq)
        if reason is not None:
            self._finish(seq, reason, flush)
        elif seq.prefill_only:
            self._park(seq)

    def _ends(self, seq: Sequence, token: int) -> tuple[str | None, bool]:
        """Whether seq, its last token `token` (in its text and format already), ends there, and why
        (None: it goes on); flush: its text is whole (not cut at a stop string). A stop string is
        cut from its text here."""
        p = seq.params
        past_min = seq.num_output >= p.min_tokens
        if past_min and token in p.stop_token_ids:
            return FINISH_STOP, True
        if past_min and not p.ignore_eos and token in self.eos_token_ids:
            return FINISH_EOS, True
        if past_min and p.stop and _cut_at_stop(seq):
            return FINISH_STOP, False
        if seq.matcher is not None and seq.matcher.is_error():  # consuming the token met one of its limits
            seq.error = self.grammars.failure(seq.params.structured_output, seq.matcher, None)
            return FINISH_ERROR, True
        if seq.matcher is not None and seq.matcher.is_stopped():
            return FINISH_STOP, True  # the format is complete (nothing may follow)
        if seq.num_output >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return FINISH_LENGTH, True
        return None, True

    def _fail(self, seq: Sequence, error: Exception) -> None:
        """End seq "error" for this reason. (A request's other samples, params.n > 1, run on: whoever
        ends the request aborts them, as a decode worker does.)"""
        log.info("request %s ends: %s", seq.parent or seq.request_id, error)
        seq.error = error
        self._finish(seq, FINISH_ERROR)

    def _fork(self, first: Sequence) -> None:
        """Start a request's samples after the first (params.n > 1), now that the first's prompt KV
        is computed: each shares its whole blocks but the last (taken, not copied), computes the
        rest of the prompt (at most a block) and samples its own first token. Sample i is seeded
        seed + i, and asks for no prompt log probabilities (the first's carry them)."""
        pool, bs, p = self.cache.pool, self.cache.block_size, first.params
        shared = first.block_table[: (first.prompt_len - 1) // bs]
        kids = []
        for i in range(1, p.n):
            child = self._new_seq(
                sample_key(first.request_id, i),
                first.token_ids[: first.prompt_len],
                first.prompt_len,
                _sample_params(p, i),
                cache_salt=first.cache_salt,
            )
            child.index, child.parent, child.priority = i, first.request_id, first.priority
            pool.take(shared)
            child.block_table.extend(shared)
            child.num_computed = len(shared) * bs
            self.scheduler.add(child)
            kids.append(child.request_id)
        self.children[first.request_id] = kids

    def _finish(self, seq: Sequence, reason: str, flush: bool = True) -> None:
        seq.finish_reason = reason
        if seq.parent and (kids := self.children.get(seq.parent)) is not None:
            if seq.request_id in kids:
                kids.remove(seq.request_id)
            if not kids:
                del self.children[seq.parent]
        if seq.detok is not None and flush:  # not after a stop string: the text was cut there
            seq.text += seq.detok.flush()
        if self.padded is not None:
            self.padded.finish(seq)
        if seq.status is not Status.FINISHED:
            self.scheduler.finish(seq)
        self.seqs.pop(seq.request_id, None)

    def _park(self, seq: Sequence) -> None:
        """prefill_only: keep the KV blocks, leave the batch; export_kv() then release()."""
        self.scheduler.running.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = FINISH_PREFILLED
        self.seqs.pop(seq.request_id, None)
        self.parked[seq.request_id] = seq

    def _output(self, seq: Sequence) -> RequestOutput | None:
        finished = seq.status is Status.FINISHED
        # Text that may be the start of a stop string is held back until the request ends: a parked
        # (prefill_only) one has not ended, and the engine it goes to holds the same back. Sent
        # with its first token, it came again with the decode worker's next one.
        ended = finished and (seq.finish_reason != FINISH_PREFILLED or seq.first_finish is not None)
        hold = 0 if ended else max((len(s) for s in seq.params.stop), default=1) - 1
        end = max(seq.emitted_chars, len(seq.text) - hold)
        new_text = seq.text[seq.emitted_chars : end]
        new_ids = seq.output_ids[seq.emitted_tokens :]
        if not new_ids and not finished:
            return None
        logprobs = seq.logprobs[seq.emitted_tokens :] if seq.params.logprobs is not None else None
        prompt_logprobs = None  # with the first token
        if seq.params.prompt_logprobs is not None and seq.emitted_tokens == 0 and new_ids:
            prompt_logprobs = seq.prompt_logprobs
            if not seq.prefill_only:  # not needed here any more (a long prompt's: megabytes)
                seq.prompt_logprobs, seq.prompt_logprobs_sent = [], True
        seq.emitted_chars, seq.emitted_tokens = end, seq.num_output
        return RequestOutput(
            request_id=seq.parent or seq.request_id,
            index=seq.index,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.prompt_len,
            num_output_tokens=seq.num_output,
            num_cached_tokens=seq.num_cached_tokens,
            error=None if seq.error is None else str(seq.error),
            exception=seq.error,
            new_logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    # -- KV handoff -------------------------------------------------------------------------

    def kv_nbytes(self, request_id: str, start: int = 0) -> int:
        seq = self.parked[request_id]
        return kv_layout.payload_nbytes(self.model.shape, seq.num_computed, start)

    def export_kv(self, request_id: str, dest: memoryview | None = None, start: int = 0) -> kv_layout.KVExport:
        """Write a parked sequence's KV (header + [layers, 2, tokens, Hkv, D]) into dest: that of
        tokens [start, num_tokens), where the consumer holds the first start in its prefix cache."""
        seq = self.parked.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id!r} has no parked KV")
        if not 0 <= start < seq.num_computed:
            raise ValueError(f"start {start} is outside [0, {seq.num_computed})")
        slots = self.cache.slots(seq.block_table, start, seq.num_computed)
        return kv_layout.export(self.model, self.cache.kv, slots, seq, dest, start)

    def release(self, request_id: str) -> None:
        """Free a parked sequence's KV blocks (after export, or if the handoff is abandoned)."""
        seq = self.parked.pop(request_id, None)
        if seq is not None:
            self.cache.pool.free(seq.block_table)

    def can_import(self, num_tokens: int) -> bool:
        return self.cache.pool.can_allocate(self.cache.pool.blocks_for(num_tokens + 1))

    def import_kv(
        self, export: kv_layout.KVExport, payload: memoryview | bytes, priority: int = 0
    ) -> RequestOutput | None:
        """Adopt a sequence exported by another engine; it continues as if it had never moved.

        Returns the tokens it already has (the first token, sampled by the producer) so
        the caller can send them at once instead of after the next step. When its blocks are
        not free, running sequences of a less urgent priority are preempted to make room;
        with none to preempt it raises CapacityError (the caller waits and retries).

        Whole blocks of its prefix already in the prefix cache (under its salt) are shared, and
        their KV in the payload is not read. KV sent without its first export.start tokens
        needs them there: KVPrefixMissing if fewer are cached (the sender sends them after all).
        """
        if self.padded is not None:
            raise KVImportError(
                "handle", f"KV import needs the continuous policy; this engine batches {self.config.policy}"
            )
        if export.request_id in self.seqs:
            raise InvalidRequestError("request_id", f"{export.request_id!r} is already in this engine")
        if SAMPLE_SEP in export.request_id:
            raise InvalidRequestError("request_id", f"must not hold {SAMPLE_SEP!r}, got {export.request_id!r}")
        kv_layout.check(self.model, export, payload)
        n, start = export.num_tokens, export.start
        if len(export.token_ids) != n + 1:
            raise KVImportError(
                "handle.num_tokens",
                f"KV holds {n} tokens but the sequence has {len(export.token_ids)} (expected n + 1)",
            )
        if not 1 <= export.prompt_len <= n:
            raise KVImportError(
                "sequence.prompt_len",
                f"{export.prompt_len} of {len(export.token_ids)} tokens: the "
                "prompt is at least one and leaves at least the token sampled",
            )
        check_vocab("sequence.token_ids", export.token_ids, self.model.shape.vocab_size)
        self.validate(export.token_ids[: export.prompt_len], export.params)
        if not 0 <= export.resumed < max(1, len(export.token_ids) - export.prompt_len) or export.resumed_chars < 0:
            raise KVImportError(
                "sequence.resumed_tokens",
                f"{export.resumed} resumed tokens ({export.resumed_chars} "
                f"characters) of {len(export.token_ids) - export.prompt_len} sampled",
            )
        if export.params.logprobs is not None and len(export.logprobs) != len(export.token_ids) - export.prompt_len:
            raise KVImportError(
                "sequence.logprobs",
                f"{len(export.logprobs)} log probabilities for "
                f"{len(export.token_ids) - export.prompt_len} sampled tokens",
            )
        if export.params.prompt_logprobs is not None and len(export.prompt_logprobs) != export.prompt_len - 1:
            raise KVImportError(
                "sequence.prompt_logprobs",
                f"{len(export.prompt_logprobs)} prompt log probabilities "
                f"for a {export.prompt_len}-token prompt (one per token after the first)",
            )
        matcher = None
        if export.params.structured_output is not None:
            try:
                matcher = self.grammars.matcher(export.params.structured_output, export.token_ids[export.prompt_len :])
            except ValueError as e:
                raise KVImportError("sequence.token_ids", f"these tokens {e}") from None
        gen = new_generator(export.params)
        if gen is not None and export.generator_state is not None:  # before a block is taken
            try:
                gen.set_state(torch.frombuffer(bytearray(export.generator_state), dtype=torch.uint8))
            except RuntimeError as e:  # of another size, or not a state torch's CPU generator makes
                raise KVImportError("sequence.generator_state", f"is not this engine's generator state: {e}") from None
        pool = self.cache.pool
        # The blocks of its prefix already in the prefix cache are shared, not filled again (and
        # the first start tokens' KV, not sent, must be among them).
        shared, entry = pool.lookup(export.token_ids, n, export.cache_salt or 0)
        held = len(shared) * pool.block_size
        if held < start:
            raise KVPrefixMissing(held, start)
        pool.take(shared)
        need = pool.blocks_for(n) - len(shared)
        if not self.scheduler.make_room(need, priority):
            pool.free(shared)
            raise CapacityError(f"no free KV blocks for {n} tokens")
        seq = self._new_seq(
            export.request_id, list(export.token_ids), export.prompt_len, export.params, gen, export.cache_salt, matcher
        )
        seq.priority = priority
        seq.logprobs = list(export.logprobs) if export.params.logprobs is not None else []
        seq.prompt_logprobs = list(export.prompt_logprobs) if export.params.prompt_logprobs is not None else []
        seq.resumed, seq.resumed_chars = export.resumed, export.resumed_chars
        self._resume(seq)
        seq.block_table.extend(shared)
        seq.block_table.extend(pool.allocate(need))
        if held < n:
            kv_layout.load(
                self.model,
                self.cache.kv,
                self.cache.slots(seq.block_table, held, n),
                payload,
                n - start,
                skip=held - start,
            )
        seq.num_computed = n
        seq.num_cache_blocks, seq.cache_entry = len(shared), entry
        seq.num_shared_on_import = self.last_shared_on_import = held
        self.scheduler.cache_computed(seq)
        self.scheduler.add(seq)
        if seq.params.n > 1:
            self._fork(seq)
        if export.finish_reason:  # its first token ended it where it was sampled: the other samples go on
            cut = export.finish_reason == FINISH_STOP and bool(seq.params.stop) and _cut_at_stop(seq)
            self._finish(seq, export.finish_reason, flush=not cut)
        return self._output(seq)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: later requests compute their whole prompt (benchmarks that
        send the same prompts again, to measure compute rather than the cache)."""
        self.cache.pool.reset_prefix_cache()

    # -- convenience ------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion; returns each one's output token ids (one sample each: n = 1)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if any(p.n > 1 for p in plist):
            raise ValueError("generate() returns one sample a prompt; for n > 1, step() and read each output's index")
        ids = [f"gen-{i}" for i in range(len(prompts))]
        for rid, p, sp in zip(ids, prompts, plist):
            self.add_request(rid, p, sp)
        result: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                result[out.request_id].extend(out.new_token_ids)
        return [result[rid] for rid in ids]


def _sample_params(p: SamplingParams, i: int) -> SamplingParams:
    """A request's sample i as a sequence of its own (params.n > 1): seeded seed + i; the first
    sample's output carries the prompt's log probabilities."""
    return dataclasses.replace(p, n=1, prompt_logprobs=None, seed=None if p.seed is None else (p.seed + i) % 2**63)


def _device_events(device: torch.device) -> tuple | None:
    """On CUDA, a pair of timing events, the first recorded now on the current stream (the
    forward's; the second is recorded after it): StepStats.device_time_s."""
    if device.type != "cuda":
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    return start, end


class _Before:
    """The states of the generators of a step's sampling rows (seqs) before its _compute or
    sampling: restore() puts them back for those of a run that failed, so that running them again
    draws the same. (The prompt log probabilities a failed run added stay: they are right, and
    _prompt_rows goes on after them. Keeping a state costs 0.7 us a random row a step.)"""

    def __init__(self, seqs: list[Sequence]):
        self.states = {id(seq): seq.generator.get_state() for seq in seqs if seq.generator is not None}

    def restore(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if (state := self.states.get(id(seq))) is not None:
                seq.generator.set_state(state)


def _seen(seq: Sequence) -> Seen:
    """What seq's penalties look at (its counts are made once, at its first sample here: an
    imported sequence's from the tokens it came with)."""
    if seq.output_counts is None:
        seq.output_counts = Counter(seq.output_ids)
    if seq.prompt_ids is None and seq.params.repetition_penalty != 1.0:
        seq.prompt_ids = torch.tensor(sorted(set(seq.token_ids[: seq.prompt_len])), dtype=torch.int64)
    counts = seq.output_counts
    return Seen(
        torch.tensor(list(counts), dtype=torch.int64),
        torch.tensor(list(counts.values()), dtype=torch.float32),
        seq.prompt_ids,
    )


def _prompt_rows(sched: SchedulerOutput) -> list[tuple[Sequence, int, int, int]]:
    """(sequence, first position, count, its batch row) of the prompt positions computed this step
    whose logits give prompt log probabilities the sequence asked for and lacks: position p's give
    prompt token p + 1's. The last prompt position's are the first token's (sampled as usual)."""
    rows = []
    row = 0
    for s in sched.scheduled:
        seq = s.seq
        if seq.wants_prompt_logprobs:
            # A recompute (after preemption) starts below what it has; the prefix cache never
            # skips past it (Sequence.max_cached), so the positions it lacks are all here.
            a = max(seq.num_computed, len(seq.prompt_logprobs))
            b = min(seq.num_computed + s.num_tokens, seq.prompt_len - 1)
            if b > a:
                rows.append((seq, a, b - a, row + a - seq.num_computed))
        row += s.num_tokens
    return rows


_PROMPT_ROWS_AT_ONCE = 256  # logits made at once: ~50 MB of float32 rows for SmolLM2's 49152-token vocabulary


def _add_prompt_logprobs(rows: list[tuple[Sequence, int, int, int]], hidden: torch.Tensor, lm_head) -> None:
    """hidden: the normed final hidden states of rows' positions, in order (lm_head makes their
    logits, a slice at a time: a chunk's 2048 rows at once would be 400 MB). Each sequence's
    prompt log probabilities grow by its positions' next prompt tokens (and the k most likely,
    k its request's)."""
    targets: list[tuple[Sequence, int]] = []
    for seq, first, n, _ in rows:
        if first != len(seq.prompt_logprobs):
            raise RuntimeError(
                f"{seq.request_id}: prompt log probabilities from {first}, but it holds {len(seq.prompt_logprobs)}"
            )
        targets.extend((seq, p + 1) for p in range(first, first + n))
    for i in range(0, len(targets), _PROMPT_ROWS_AT_ONCE):
        part = targets[i : i + _PROMPT_ROWS_AT_ONCE]
        dist = torch.log_softmax(lm_head(hidden[i : i + len(part)]).float(), dim=-1)
        found = token_logprobs(
            dist, [seq.token_ids[at] for seq, at in part], [seq.params.prompt_logprobs for seq, _ in part]
        )
        for (seq, _), lp in zip(part, found):
            seq.prompt_logprobs.append(lp)


def _cut_at_stop(seq: Sequence) -> bool:
    """If the output text now holds a stop string, cut the text before it (after it, with
    include_stop_str_in_output) and say so. Of stop strings found, the one that starts first (the
    first listed, of those starting there) ends it."""
    longest = max(len(s) for s in seq.params.stop)
    start = max(0, seq.emitted_chars - longest)
    hits = [(i, n) for n, i in enumerate(seq.text.find(s, start) for s in seq.params.stop) if i >= 0]
    if not hits:
        return False
    at, n = min(hits)
    seq.text = seq.text[: at + (len(seq.params.stop[n]) if seq.params.include_stop_str_in_output else 0)]
    return True
