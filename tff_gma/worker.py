"""Runs one TFF C++ worker in the foreground, for multi-host simulations; Ctrl-C stops it (one line, exit 130).

Usage: `python -m tff_gma.worker --port=8000 [--bind=ADDRESS] [--log_path=PATH]`, or `--unix=PATH` instead of
`--port`/`--bind`; drivers connect with `python -m training.run --workers=host1:8000,...` (or `unix:PATH`). TFF's
protocol has no authentication: the worker runs confined behind a listener that admits only this user among the
local ones, and prints at start exactly who can connect.
"""

import getpass
import os
import signal
import sys

from absl import app
from absl import flags

from tff_gma import runtime
from tff_gma.runtime import listeners

_PORT = flags.DEFINE_integer('port', 8000, 'TCP port to serve on (0: pick a free one).')
_BIND = flags.DEFINE_string(
    'bind', '', "Address of this host to serve on: '' (default) = all interfaces; e.g. a private network's "
    'address, or 127.0.0.1 behind an SSH tunnel. Other hosts that reach it can run code in the worker; of the '
    "local users, only this command's.")
_UNIX = flags.DEFINE_string(
    'unix', None, 'Serve on a Unix socket at this path instead of TCP (0600, in a directory of your own with '
    'mode 0700, created if missing): only your own processes can connect; drivers use --workers=unix:PATH, or an '
    'SSH forward (ssh -L 8000:PATH host).')
_LOG = flags.DEFINE_string('log_path', None, "The worker's log file ('stderr' to show it); default: discard.")


def _user() -> str:
  try:
    return f'{getpass.getuser()} (uid {os.geteuid()})'
  except (KeyError, OSError):
    return f'uid {os.geteuid()}'


def exposure_message(worker: runtime.WorkerProcess) -> str:
  """The start-up message: where the worker listens, exactly who can connect, and how to restrict it."""
  user = _user()
  root_too = ', root included' if os.geteuid() != 0 else ''
  if worker.unix_path is not None:
    path = worker.target[len('unix:'):]
    where = f'the Unix socket {path}'
    lines = [
        f'TFF worker (pid {worker.pid}) listening on {where} only (no TCP port); drivers on this host use '
        f'--workers={worker.target}, drivers on other hosts an SSH forward: ssh -N -L 8000:{path} <this host>, '
        'then --workers=localhost:8000.',
        f'Who can connect: only processes of {user} (the socket is 0600 in a 0700 directory, and the forwarder '
        f'closes any connection from another uid{root_too}). No other host can connect.',
    ]
  else:
    everywhere = worker.listen_host in ('', '0.0.0.0', '::')
    where = f'all interfaces of this host, port {worker.port}' if everywhere else f'{worker.target} only'
    lines = [f'TFF worker (pid {worker.pid}) listening on {where}; drivers use --workers=<this host>:{worker.port}.']
    if not worker.confined:
      lines.append(f'Who can connect: ANY local process of any user, and any host that can reach {where}: the '
                   'worker itself listens there, NOT confined, and nothing checks who connects.')
    elif listeners.is_loopback_host(worker.listen_host):
      lines.append(f'Who can connect: only processes of {user} on this host (the forwarder closes connections '
                   f"from other users' sockets{root_too}), e.g. an SSH tunnel that this user opened: "
                   f'ssh -N -L {worker.port}:{worker.target} <this host>. No other host can connect.')
    else:
      lines.append(f'Who can connect: any host that can reach {where}, and on this host only processes of {user} '
                   f"(the forwarder closes connections from other users' sockets{root_too}).")
  lines.append('The protocol is UNAUTHENTICATED: whoever can connect can run arbitrary TensorFlow graphs in the '
               f'worker as {user}: read and write its files.')
  if worker.confined:
    lines.append(f'The worker runs in a private {worker.confined}: this listener is the only way in, and the '
                 'worker cannot open network connections itself.')
  else:
    lines.append(f'The worker is NOT confined ({listeners.confinement_status()}): it listens on all interfaces '
                 'itself.')
  if worker.unix_path is None and worker.listen_host in ('', '0.0.0.0', '::'):
    lines.append('Restrict it with --bind=<an address on a private network>, --bind=127.0.0.1 or --unix=PATH '
                 'behind an SSH tunnel, a firewall rule that admits only the driver, or a private network.')
  lines.append('Ctrl-C stops it.')
  return '\n'.join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if _UNIX.value is not None and (flags.FLAGS['port'].present or flags.FLAGS['bind'].present):
    print('error: --unix serves on a Unix socket instead of TCP: leave out --port and --bind', file=sys.stderr)
    sys.exit(1)
  if _UNIX.value is not None and not _UNIX.value.strip():
    print('error: --unix needs a path (e.g. --unix=$HOME/.tff_gma/worker.sock)', file=sys.stderr)
    sys.exit(1)
  try:
    if _UNIX.value is not None:
      worker = runtime.WorkerProcess(log_path=_LOG.value, unix_path=_UNIX.value)
    else:
      worker = runtime.WorkerProcess(log_path=_LOG.value, port=_PORT.value or None, listen_host=_BIND.value)
    worker.start()
  except (RuntimeError, ValueError) as e:  # Confinement refused, a bad socket directory, a log path refused.
    print(f'error: {e}', file=sys.stderr, flush=True)
    sys.exit(1)
  except OSError as e:  # The port taken, the address not this host's.
    where = 'that Unix socket' if _UNIX.value is not None else f'{_BIND.value or "all interfaces"}, port {_PORT.value}'
    print(f'error: cannot serve the TFF worker on {where}: {e.strerror or e}', file=sys.stderr, flush=True)
    sys.exit(1)
  print(exposure_message(worker), flush=True)
  signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
  try:
    worker._process.wait()  # pylint: disable=protected-access
  except KeyboardInterrupt:  # The banner's way to stop it: no traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # The stop is bounded (it ends in SIGKILL): let it finish.
    worker.stop()
    print('TFF worker stopped.', file=sys.stderr, flush=True)
    sys.exit(130)
  finally:
    worker.stop()


if __name__ == '__main__':
  runtime.set_up_entry_point()  # TFF's import-time context released now, not at shutdown (with a traceback).
  app.run(main)
