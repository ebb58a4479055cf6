import os
import sys

# NOTE: a prefill and a decode worker usually share the machine's cores; OpenMP threads
# that spin while waiting steal them from the other process (measured: the service ran at
# 0.83x the in-process engine with spinning threads, 1.06x with passive ones). A short spin
# before sleeping bridges the gaps between the ops of one forward: with a purely passive
# wait every op paid a thread wake-up and a lone prefill ran ~8% slower than in-process
# (light-load TTFT +45..65 ms). With GOMP_SPINCOUNT=2000 the lone prefill is 1-3% slower
# than in-process; the all-at-once throughput ratio may lose a few % (one A/B run each:
# 0.89/0.86 without the spin, 0.83/0.86 with it). README, "Service vs in-process". Set
# before torch loads its OpenMP runtime; explicit OMP_WAIT_POLICY / GOMP_SPINCOUNT win.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "2000")

from splitserve.prefill_worker.worker import main

sys.exit(main())
