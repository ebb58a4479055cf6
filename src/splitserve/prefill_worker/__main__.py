import os
import sys

# NOTE: a prefill and a decode worker usually share the machine's cores; OpenMP threads
# that spin while waiting steal them from the other process (measured: the service ran at
# 0.83x the in-process engine with spinning threads, 1.06x with passive ones). A short
# spin (~20 us) before sleeping bridges the gaps between the ops of one forward: without
# it every op paid a thread wake-up and a lone prefill ran ~8% slower than in-process
# (light-load TTFT +45..65 ms); with it the prefill matches the in-process engine and the
# all-at-once throughput is unchanged (README, "Service vs in-process"). Set before torch
# loads its OpenMP runtime; explicit OMP_WAIT_POLICY / GOMP_SPINCOUNT win.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "2000")

from splitserve.prefill_worker.worker import main

sys.exit(main())
