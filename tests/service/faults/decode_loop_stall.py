"""A decode worker whose event loop is held for 5 s, once: at the third token of a request whose
id starts with stall-loop (as a burst of streams and handoffs holds it).

Imported first (as a sitecustomize) by one role's processes: see common.with_module."""

import time

import splitserve.decode_worker.server as d

emit, stalled = d.DecodeServicer._emit, []


def _emit(self, slot, out):
    if slot.request_id.startswith("stall-loop") and out.num_output_tokens >= 3 and not stalled:
        stalled.append(1)
        time.sleep(5.0)  # on the event loop: nothing else in this process's loop runs meanwhile
    return emit(self, slot, out)


d.DecodeServicer._emit = _emit
