import sys

from splitserve.prefill_worker.worker import main

sys.exit(main())
