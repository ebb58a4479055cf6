import sys

from splitserve.decode_worker.server import serve
from splitserve.service.process import run

sys.exit(run("decode_worker", serve))
