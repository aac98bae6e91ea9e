"""Test helpers: whether a process is alive, waiting for it to be gone (from /proc), and children that take
signals as a script started from a terminal does."""

import os
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


def kill_session(pid: int) -> None:
  """SIGKILL to the session (process group) led by `pid`, if any of it is left: what a test that started a child
  with `start_new_session=True` does last, since TFF's own worker may outlive the child."""
  try:
    os.killpg(pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


# The prefix of a child's argv that must take SIGINT/SIGQUIT/SIGHUP by default. A test suite started as a shell's
# background job (`cmd &`, nohup) ignores them, and a child would inherit that: Ctrl-C would not interrupt it, and
# TFF's own worker, which TFF stops with SIGINT, would never stop. coreutils' env resets them and execs the command
# (same pid). Not a `preexec_fn`: that makes `subprocess` fork and run Python in the child, and in a test process
# whose TFF contexts left gRPC threads running, gRPC's fork handler can abort the child before it execs (seen in CI:
# "Other threads are currently calling into gRPC, skipping fork() handlers", then "Check failed:
# next_worker->state == KICKED", the child dead by SIGABRT); without one, `subprocess` uses vfork and no fork
# handler runs.
DEFAULT_SIGNALS = ('env', '--default-signal=INT,QUIT,HUP')
