"""The engine's side of each sampled token: a sequence's sampling row, the token taken in (stop
strings, stop tokens, length), samples forked from one prompt, and the outputs handed back."""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter

import torch

from splitserve.engine.errors import (
    StepFailed,
)
from splitserve.engine.outputs import (
    FINISH_EOS,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_PREFILLED,
    FINISH_STOP,
    RequestOutput,
    TokenLogprob,
    sample_key,
)
from splitserve.engine.sampling import (
    SampleRow,
    SamplingParams,
    Seen,
    sample_with_logprobs,
)
from splitserve.engine.sequence import Sequence, Status

log = logging.getLogger(__name__)


class SequenceUpdates:
    """LLMEngine's updates of a sequence as its tokens come: sampling rows, ends, forks, outputs.
    State: the engine's."""

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
        before = Before(seqs)
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
        if past_min and p.stop and cut_at_stop(seq):
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
                sample_params(p, i),
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


class Before:
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


def cut_at_stop(seq: Sequence) -> bool:
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


def sample_params(p: SamplingParams, i: int) -> SamplingParams:
    """A request's sample i as a sequence of its own (params.n > 1): seeded seed + i; the first
    sample's output carries the prompt's log probabilities."""
    return dataclasses.replace(p, n=1, prompt_logprobs=None, seed=None if p.seed is None else (p.seed + i) % 2**63)
