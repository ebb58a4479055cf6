"""The engine's side of the KV handoff: a prefilled sequence's KV exported (prefill worker), and
a sequence imported with its KV to decode (decode worker). The layout is splitserve.handoff's."""

from __future__ import annotations

import logging

import torch

from splitserve.engine.errors import (
    CapacityError,
    InvalidRequestError,
    KVImportError,
    KVPrefixMissing,
)
from splitserve.engine.outputs import (
    FINISH_STOP,
    SAMPLE_SEP,
    RequestOutput,
)
from splitserve.engine.params import check_vocab
from splitserve.engine.sampling import (
    new_generator,
)
from splitserve.engine.tokens import cut_at_stop
from splitserve.handoff import layout as kv_layout

log = logging.getLogger(__name__)


class KVTransfer:
    """LLMEngine's KV export and import. State: the engine's."""

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
            cut = export.finish_reason == FINISH_STOP and bool(seq.params.stop) and cut_at_stop(seq)
            self._finish(seq, export.finish_reason, flush=not cut)
        return self._output(seq)
