import os
import sys

# NOTE: a prefill and a decode worker usually share the machine's cores; OpenMP threads
# that spin while waiting steal them from the other process (measured: the service ran at
# 0.83x the in-process engine with spinning threads, 1.06x with passive ones). A short spin
# before sleeping bridges the gaps between the ops of one forward: with a purely passive
# wait every op paid a thread wake-up and a lone prefill ran ~8% slower than in-process
# (light-load TTFT +45..65 ms). Before the core-share board, a 30000 spin cost throughput
# (ratio 0.73 vs 0.86 at 2000); with the board a prefill worker beside a busy decode worker
# runs one thread, which never spins. Four A/B pairs with the board: throughput ratio
# 0.89 / 0.84 / 0.88 / 0.86 at 30000 vs 0.83 / 0.84 / 0.84 / 0.82 at 2000; the light-load
# TTFT added did not differ beyond noise (19.4 / 12.3 / 22.8 / -2.2 vs 13.2 / 19.5 / 45.2 / 1.0 ms).
# README, "Service vs in-process". Set before torch loads its OpenMP runtime; explicit
# OMP_WAIT_POLICY / GOMP_SPINCOUNT win.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "30000")

from splitserve.prefill_worker.worker import main

sys.exit(main())
