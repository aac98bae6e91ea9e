"""Test helpers: whether a process is alive, waiting for it to be gone (from /proc), and children that take
signals as a script started from a terminal does."""

import signal
import time


def alive(pid: int) -> bool:
  """Whether `pid` is a live process (not gone, not a zombie). The state follows the command's closing ')'."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] not in ('Z', 'X')
  except FileNotFoundError:
    return False


def wait_gone(pid: int, timeout: float = 15.0) -> bool:
  """True once `pid` is no longer alive, False if it still is after `timeout` seconds."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if not alive(pid):
      return True
    time.sleep(0.1)
  return False


def default_signals() -> None:
  """`preexec_fn` for a child that must take SIGINT/SIGQUIT/SIGHUP by default. A test suite started as a shell's
  background job (`cmd &`, nohup) ignores them, and a child would inherit that: Ctrl-C would not interrupt it, and
  TFF's own worker, which TFF stops with SIGINT, would never stop."""
  for signum in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
    signal.signal(signum, signal.SIG_DFL)
