"""A command in a private mount namespace with a small tmpfs of its own: a read-only or a full disk, for real.

Root ignores permission bits (a chmod 0555 directory stays writable to it), so the tests make read-only and full
file systems with real mounts: `unshare --mount` gives the command a mount namespace of its own, the tmpfs is
mounted there over an empty directory of the test, and it vanishes with the command (no mount outlives the test,
and nothing outside the namespace sees it). Needs root and a kernel that allows the namespace; `require()` skips
the test otherwise, saying which.
"""

import os
import shutil
import subprocess

import pytest


def require() -> None:
  """Skips the calling test when a private tmpfs cannot be mounted here."""
  if os.geteuid() != 0:
    pytest.skip('needs root: a read-only or full file system is made by mounting a tmpfs in a private mount '
                'namespace (as another user, permission bits would do, but not the same for every command)')
  if shutil.which('unshare') is None:
    pytest.skip('needs util-linux unshare, to mount a tmpfs in a private mount namespace')
  probe = subprocess.run(['unshare', '--mount', '--propagation', 'private', 'true'], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=60)
  if probe.returncode != 0:
    pytest.skip(f'unshare --mount refused here ({probe.stderr.strip()}): no private mount namespace')


def run_on_tmpfs(mount_point, script: str, *, size: str = '1m', read_only: bool = False, env=None, cwd=None,
                 timeout: float = 300) -> subprocess.CompletedProcess:
  """Runs the shell `script` with a tmpfs of `size` (read-only if asked) mounted over `mount_point`.

  The script sees the mount point as $MNT; the mount exists only in the script's own mount namespace.
  """
  os.makedirs(mount_point, exist_ok=True)
  setup = f'mount -t tmpfs -o size={size},mode=0755 tmpfs "$MNT"'
  if read_only:
    setup += ' && mount -o remount,ro "$MNT"'
  return subprocess.run(
      ['unshare', '--mount', '--propagation', 'private', 'sh', '-c', f'{setup} || exit 99\n{script}'],
      env=dict(env if env is not None else os.environ, MNT=str(mount_point)), cwd=cwd, capture_output=True,
      text=True, stdin=subprocess.DEVNULL, timeout=timeout)
