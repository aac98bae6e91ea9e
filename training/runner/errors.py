"""The runner's refusals and its stop: each a message for the user, not a bug.

One line naming the setting, the directory or the cause (`training.command_line.is_run_refusal` reads them from
`training.runner.experiment`)."""

from __future__ import annotations

from training import safe_files
from training.runner import checkpoints
from training.runner import dir_lock


class TrainingStopped(RuntimeError):
  """The run stopped before its last round because it cannot recover (the message says why); its summary.json
  is written, with `stopped` saying the same."""


class ConfigError(ValueError):
  """A setting is unknown or inconsistent (the message names it); raised before anything is written."""


# The output directory refuses the run (raised by `run` after the settings' checks, before training):
UnsafeOutputError = safe_files.UnsafeOutputError  # Writable by other users, or a link planted at an output's name.
DirectoryLockedError = dir_lock.DirectoryLockedError  # Another run holds it (names the directory and the pid).
CheckpointError = checkpoints.CheckpointError  # Checkpoints exist and none loads (names the damaged paths).
