"""Runs one TFF C++ worker in the foreground, for multi-host simulations.

    python -m tff_gma.worker --port=8000 [--bind=10.0.0.5] [--log_path=worker.log]

The driver connects with `python -m training.run --workers=host1:8000,host2:8000 ...`. The worker must be
reachable by that driver, and TFF's executor service has no authentication: whoever can connect to the port
runs TensorFlow graphs in the worker (reading and writing files, as the user running this command). At start
this command prints exactly who can connect. Restrict it:

* `--bind=ADDRESS`: serve only on that address of this host (an address on a private network between the
  driver and the workers, or 127.0.0.1 with the driver reaching it through an SSH tunnel). The worker itself
  then runs in a private network namespace and is reached only through this listener (`tff_gma.confinement`);
  where the kernel refuses that namespace, `--bind` other than all interfaces is refused.
* a firewall rule that accepts the port only from the driver's host, or a private network.

The worker stops with this process (Ctrl-C, SIGTERM, or this process dying: PR_SET_PDEATHSIG).
"""

import getpass
import os
import signal
import sys

from absl import app
from absl import flags

from tff_gma import runtime

_PORT = flags.DEFINE_integer('port', 8000, 'TCP port to serve on (0: pick a free one).')
_BIND = flags.DEFINE_string(
    'bind', '', "Address of this host to serve on: '' (default) = all interfaces; e.g. a private network's "
    'address, or 127.0.0.1 behind an SSH tunnel. Anyone who can connect can run code in the worker.')
_LOG = flags.DEFINE_string('log_path', None, "The worker's log file ('stderr' to show it); default: discard.")


def _user() -> str:
  try:
    return f'{getpass.getuser()} (uid {os.geteuid()})'
  except (KeyError, OSError):
    return f'uid {os.geteuid()}'


def exposure_message(worker: runtime.WorkerProcess) -> str:
  """The start-up message: where the worker listens, that it is unauthenticated, and how to restrict it."""
  everywhere = worker.listen_host in ('', '0.0.0.0', '::')
  where = f'all interfaces of this host, port {worker.port}' if everywhere else f'{worker.target} only'
  lines = [
      f'TFF worker (pid {worker.pid}) listening on {where}; drivers use --workers=<this host>:{worker.port}.',
      f'UNAUTHENTICATED: any process that can connect to it (any host that can reach {where}, any local '
      f'process) can run arbitrary TensorFlow graphs in the worker as {_user()}: read and write its files.',
  ]
  if worker.confined:
    lines.append(f'The worker runs in a private {worker.confined}: this listener is the only way in, and the '
                 'worker cannot open network connections itself.')
  else:
    lines.append(f'The worker is NOT confined ({runtime.confinement_status()}): it listens on all interfaces '
                 'itself.')
  if everywhere:
    lines.append('Restrict it with --bind=<an address on a private network> (or 127.0.0.1 behind an SSH tunnel), '
                 'a firewall rule that admits only the driver, or a private network.')
  lines.append('Ctrl-C stops it.')
  return '\n'.join(lines)


def main(argv):
  del argv
  worker = runtime.WorkerProcess(log_path=_LOG.value, port=_PORT.value or None, listen_host=_BIND.value).start()
  print(exposure_message(worker), flush=True)
  signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
  try:
    worker._process.wait()  # pylint: disable=protected-access
  finally:
    worker.stop()


if __name__ == '__main__':
  app.run(main)
