"""LLMEngine: add requests, call ``step()``, read outputs.

step = schedule -> execute -> update. The same engine runs whole in one process
(the baseline and the tests), as a prefill worker (``prefill_only`` requests park
their KV for export after the first token) and as a decode worker (``import_kv``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque

import torch

from splitserve.engine import cache_dir, layout_cache, native, pack_cache
from splitserve.engine.config import EngineConfig, resolve_dtype
from splitserve.engine.cores import CoreShare
from splitserve.engine.cuda_graphs import DecodeGraphs, PiecewiseGraphs
from splitserve.engine.errors import (
    InvalidRequestError,
)
from splitserve.engine.kv_cache import PagedKVCache
from splitserve.engine.kv_io import KVTransfer
from splitserve.engine.loader import LoadedModel, load_model, native_blocks
from splitserve.engine.model import LlamaModel
from splitserve.engine.outputs import (
    FINISH_CANCELLED,
    SAMPLE_SEP,
    RequestOutput,
    StepStats,
    placeholder_logprobs,
    sample_key,
)
from splitserve.engine.padded import PaddedBatcher
from splitserve.engine.params import check_context, check_vocab
from splitserve.engine.sampling import (
    SamplingParams,
    new_generator,
)
from splitserve.engine.scheduler import ContinuousScheduler
from splitserve.engine.sequence import Sequence
from splitserve.engine.step import Stepping
from splitserve.engine.structured import MASK_WINDOW, Grammars
from splitserve.engine.tokens import SequenceUpdates, sample_params

log = logging.getLogger(__name__)


class LLMEngine(Stepping, SequenceUpdates, KVTransfer):
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
                shape.num_heads,
                shape.num_kv_heads,
                shape.head_dim,
                self.device,
                config.block_size,
                self.max_model_len,
                self.model.dtype,
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
        self.paused: set[str] = set()  # request ids paused (pause_request); some may have ended since
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
        dtype = resolve_dtype(config.dtype, loaded.checkpoint_dtype, config.device)
        fp32 = dtype == "float32"
        # the weights in the model's layout: the first engine's on them in this process, or from the disk
        # cache (both fp32: an engine of another dtype lays its own out)
        cached = bool(loaded.layout_entry) and on_cpu and fp32 and not loaded.laid_out
        with cache_dir.making(loaded.layout_entry, waiting) if cached else contextlib.nullcontext():
            laid = loaded.laid_out or (layout_cache.read(loaded.layout_entry) if cached else None)
            self.model = LlamaModel(loaded, laid, dtype)
            if on_cpu and fp32 and not loaded.laid_out:  # (on a GPU, the host's copy would be kept for nothing)
                loaded.laid_out = self.model.laid_out()
                if cached and self.model.made_layout and laid is None:  # made here: kept for later processes
                    layout_cache.write(loaded.layout_entry, loaded.laid_out)
                    log.info("weights laid out for the model, kept at %s", loaded.layout_entry)
                elif laid is not None and self.model.made_layout:
                    log.warning("weights laid out at %s did not fit the model: made again", loaded.layout_entry)
        if config.attention_backend == "native" and on_cpu and fp32:  # (the C kernels are fp32 only)
            lib = native.load_paged_attention(config.model.cache_dir)
            if lib is not None:
                self.model.attn_kernel = native.PagedAttention(lib, self.num_threads)
        if config.small_gemm and on_cpu and fp32:
            lib = native.load_small_gemm(config.model.cache_dir)
            if lib is not None:
                self._pack_weights(lib, loaded, config.weights, tick, waiting)
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

    def _pack_weights(self, lib, loaded: LoadedModel, weights: str, tick, waiting) -> None:
        """The small-GEMM kernel's weights: the checkpoint's own blocks (weights "native") or fp32
        tiles, made by the first engine on these weights in this process, or read from the disk cache
        (pack_cache), or made and kept there."""
        cache = loaded.packed.setdefault(weights, {})
        entry = pack_cache.for_weights(loaded.pack_entry, weights) if loaded.pack_entry else ""
        first = bool(entry) and not cache
        with cache_dir.making(entry, waiting) if first else contextlib.nullcontext():
            known = pack_cache.read(entry) if first else None
            t = time.perf_counter()
            # the file's blocks only when weights are packed from nothing: a cache (this process's, or the
            # disk's) holds them laid out already
            blocks = native_blocks(loaded) if weights == "native" and not cache and known is None else None
            self.model.use_small_gemm(
                native.SmallGemm(lib, self.num_threads), between=tick, cache=cache, known=known, blocks=blocks
            )
            if first and known is None:  # made here: kept for later processes
                pack_cache.write(entry, cache)
                log.info(
                    "small-GEMM weights (%s) packed in %.1f s, kept at %s", weights, time.perf_counter() - t, entry
                )

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
                    sample_params(params, i),
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
        self.paused.discard(request_id)
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

    def has_work(self) -> bool:
        """Whether a step would compute anything: an unfinished sequence that is not paused."""
        if not self.paused:
            return bool(self.seqs)
        return any(not s.paused for s in self.seqs.values())

    def pause_request(self, request_id: str, paused: bool = True) -> bool:
        """Leave a request's sequences out of the steps (its reader is behind), keeping their KV
        and their place; or put them back (paused False). Blocks run short: a paused sequence is
        preempted like any other (its KV freed, recomputed once it runs). Only the continuous
        policy pauses (the padded ones run fixed batches); False when there is nothing to pause."""
        seqs = [self.seqs.get(k) for k in (request_id, *self.children.get(request_id, ()))]
        seqs = [s for s in seqs if s is not None]
        if self.padded is not None or not seqs:
            self.paused.discard(request_id)
            return False
        for seq in seqs:
            seq.paused = paused
        if paused:
            self.paused.add(request_id)
        else:
            self.paused.discard(request_id)
        return True

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

    # -- after sampling ---------------------------------------------------------------------

    # -- KV handoff -------------------------------------------------------------------------

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
