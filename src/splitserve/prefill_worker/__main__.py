import os
import sys

# NOTE: a prefill and a decode worker usually share the machine's cores; OpenMP threads
# that spin while waiting steal them from the other process (measured: the service ran at
# 0.83x the in-process engine with spinning threads, 1.06x with passive ones). Set before
# torch loads its OpenMP runtime; an explicit OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from splitserve.prefill_worker.worker import main

sys.exit(main())
