import sys

from splitserve.router.server import serve
from splitserve.service.process import run

sys.exit(run("router", serve))
