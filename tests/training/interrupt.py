"""Stopping a run after a given round (the runner's `on_round` hook), for the resume tests."""

import pytest

from training import config as config_lib
from training.runner import experiment


class Interrupted(Exception):
  """Raised by `stop_after`'s hook: a run stopped between rounds, as a killed process would be."""


def stop_after(last_round: int):
  """An `on_round` hook that interrupts the run once `last_round` has finished (and saved, if it saves)."""

  def on_round(round_num, state):
    del state
    if round_num == last_round:
      raise Interrupted()

  return on_round


def run_until(config: config_lib.ExperimentConfig, last_round: int, **run_kwargs) -> None:
  """Runs `config` and interrupts it after `last_round`."""
  with pytest.raises(Interrupted):
    experiment.run(config, show_progress=False, on_round=stop_after(last_round), **run_kwargs)
