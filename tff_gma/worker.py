"""Runs one TFF C++ worker in the foreground, for multi-host simulations.

    python -m tff_gma.worker --port=8000 [--log_path=worker.log]

The worker serves TFF's executor service on the port (all interfaces; run it on a trusted network); the driver
connects with `python -m training.run --workers=host1:8000,host2:8000 ...`. The worker stops with this process
(Ctrl-C, SIGTERM, or this process dying: PR_SET_PDEATHSIG).
"""

import signal
import sys

from absl import app
from absl import flags

from tff_gma import runtime

_PORT = flags.DEFINE_integer('port', 8000, 'Port to serve on.')
_LOG = flags.DEFINE_string('log_path', None, "The worker's log file ('stderr' to show it); default: discard.")


def main(argv):
  del argv
  worker = runtime.WorkerProcess(log_path=_LOG.value, port=_PORT.value).start()
  print(f'TFF worker serving on port {worker.port} (pid {worker.pid}); Ctrl-C stops it.', flush=True)
  signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
  try:
    worker._process.wait()  # pylint: disable=protected-access
  finally:
    worker.stop()


if __name__ == '__main__':
  app.run(main)
