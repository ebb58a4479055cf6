"""Faults in a decode worker's telling of engine outputs, by request id: its first output
(boom-first; the prefill worker's FirstToken may have told the first token already) or its
third token's (boom-later).

Imported first (as a sitecustomize) by one role's processes: see common.with_module."""

import splitserve.decode_worker.server as d

emit = d.DecodeServicer._emit


def _emit(self, slot, out):
    rid = slot.request_id
    if rid.startswith("boom-first") or rid.startswith("boom-later") and out.num_output_tokens >= 3:
        raise RuntimeError("output fault")
    return emit(self, slot, out)


d.DecodeServicer._emit = _emit
