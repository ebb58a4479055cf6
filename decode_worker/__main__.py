import os
import sys

# NOTE: a prefill and a decode worker usually share the machine's cores; OpenMP threads
# that spin while waiting steal them from the other process (measured: the service ran at
# 0.83x the in-process engine with spinning threads, 1.06x with passive ones). That was
# before the core-share board; with it, a worker beside a busy one runs one thread, which
# never spins. A short spin bridges the gaps between the many small ops of a decode step:
# with GOMP_SPINCOUNT=30000 a step of 1 sequence took 14.1-14.3 ms against 16.7-17.2 ms
# with a purely passive wait, and of 8 sequences 34.4-37.1 against 37.1-38.1 ms (three
# runs each). Same as the prefill worker (see there). Set before torch loads its OpenMP
# runtime; explicit OMP_WAIT_POLICY / GOMP_SPINCOUNT win.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "30000")

from splitserve.decode_worker.server import serve
from splitserve.service.process import run

sys.exit(run("decode_worker", serve))
