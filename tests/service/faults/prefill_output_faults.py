"""Faults in a prefill worker's handing on of an ended prefill, by request id: before its first token
goes out (boom-first), after its region is taken (boom-export), and for a request its first token
ends (boom-done, the handoff of a finished sequence).

Imported first (as a sitecustomize) by one role's processes: see common.with_module."""

import splitserve.prefill_worker.handoff as h
import splitserve.prefill_worker.worker as w
from splitserve.engine.engine import LLMEngine

first_token, export_kv, kv_export = w.PrefillWorker._first_token, LLMEngine.export_kv, h.KVExport
observe_step, observed = w.PrefillWorker._observe_step, []
restore_lost, beats = w.PrefillWorker._restore_lost, []


def _raise_for(request_id, kind):
    if request_id.startswith("boom-" + kind):
        raise RuntimeError(kind + " fault")


def _first_token(self, fl, out, wait_s):
    _raise_for(fl.job.request_id, "first")
    return first_token(self, fl, out, wait_s)


def _export_kv(self, request_id, *args, **kw):
    _raise_for(request_id, "export")
    return export_kv(self, request_id, *args, **kw)


def _kv_export(request_id, *args, **kw):
    _raise_for(request_id, "done")
    return kv_export(request_id, *args, **kw)


def _observe_step(self, t0, links):  # and a step's metrics, once
    observed.append(t0)
    if len(observed) == 3:
        raise RuntimeError("metrics fault")
    return observe_step(self, t0, links)


def _restore_lost(self):  # and a heartbeat's round, once
    beats.append(1)
    if len(beats) == 3:
        raise RuntimeError("heartbeat fault")
    return restore_lost(self)


w.PrefillWorker._first_token, LLMEngine.export_kv, h.KVExport = _first_token, _export_kv, _kv_export
w.PrefillWorker._observe_step, w.PrefillWorker._restore_lost = _observe_step, _restore_lost
