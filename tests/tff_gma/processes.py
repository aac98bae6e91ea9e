"""Test helpers: whether a process is alive, and waiting for it to be gone (from /proc)."""

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
