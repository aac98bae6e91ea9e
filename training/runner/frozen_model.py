"""A run whose model has stopped moving: its weights bit for bit the round before's, or its aggregator's flags set.

A broken aggregator can return a zero update every round (an RFA whose inner mean returns zeros): the run trains
nothing while its metrics look calm. One unchanged round is no sign (every client dropped), `max_frozen_rounds` in a
row are: `round_steps.stop_if_frozen` stops the run. Each unchanged round's row holds the count (`COLUMN`), so a
resumed run counts on from its checkpoint's round. Detail: docs/experiments.md#one-experiment-python--m-trainingrun"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np

from training import config as config_lib
from training import safe_files

# The row entry of a round whose model is bit for bit the round before's: the rounds in a row so far, this one
# included. Absent where the model moved, so the rows of a run that trains are the same with and without the stop.
COLUMN = 'model_unchanged_rounds'


def same_bits(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> bool:
  """Whether the weights `a` and `b` are the same bit for bit (0.0 and -0.0 differ; a NaN equals itself)."""
  return len(a) == len(b) and all(_same_array_bits(x, y) for x, y in zip(a, b))


def _same_array_bits(x, y) -> bool:
  x, y = np.ascontiguousarray(x), np.ascontiguousarray(y)
  if x.dtype != y.dtype or x.shape != y.shape:
    return False
  return np.array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))


@dataclasses.dataclass
class FrozenModel:
  """The trainable weights after the last round seen, and how many rounds in a row before it left them unchanged."""
  weights: list[np.ndarray]
  unchanged: int = 0

  def update(self, weights: Sequence[np.ndarray], no_update: bool = False) -> int:
    """Takes the weights after the next round; returns the rounds in a row, ending with it, whose model did not
    change or whose aggregator said it returned no update (`no_update`; 0 when neither)."""
    self.unchanged = self.unchanged + 1 if no_update or same_bits(weights, self.weights) else 0
    self.weights = list(weights)
    return self.unchanged


# The library's aggregators' flags (`tff_gma.aggregators.result_checks`): the update the server got was zero
# although clients sent non-zero ones, or was non-finite and replaced by zeros. An adaptive server optimizer keeps
# moving the model on its momentum then, which the bit-for-bit comparison alone does not see.
NO_UPDATE_FLAGS = ('/zero_result', '/nonfinite_result')


def aggregator_returned_no_update(row: dict) -> bool:
  """Whether a round's row has an aggregator flag (`NO_UPDATE_FLAGS`) set."""
  return any(key.endswith(NO_UPDATE_FLAGS) and value == 1 for key, value in row.items())


def resumed_unchanged(csv_path: str, round_num: int) -> int:
  """The unchanged rounds in a row that ended with round `round_num`, from its row in metrics.csv (0 where it has
  none: the model moved, the run starts at round 0, or the file is missing).

  Rows are written before their round's checkpoint, so a run resumed from round `round_num` finds its row here;
  counting on from it stops a frozen run at the round an uninterrupted run stops."""
  if round_num <= 0 or not os.path.exists(csv_path):
    return 0
  for _, row in safe_files.read_csv(csv_path)[1]:
    if _number(row.get('round')) == round_num:
      return int(_number(row.get(COLUMN)) or 0)
  return 0


def _number(text) -> float | None:
  try:
    return float(text)
  except (TypeError, ValueError):
    return None


def stop_message(config: config_lib.ExperimentConfig, round_num: int, unchanged: int,
                 all_clients_dropped: bool) -> str:
  """The one line of a run stopped after round `round_num`, its model unchanged for the `unchanged` rounds before:
  the rounds, the aggregator as the command line named it, the likely cause and how to let such a run go on."""
  first = round_num - unchanged + 1
  if all_clients_dropped:
    cause = (f'every client was dropped as non-finite (all_clients_dropped = 1): a diverging run? Try a smaller '
             f'--client_lr={config.client_lr:g} or --server_lr={config.server_lr:g}')
  else:
    cause = (f'likely the aggregator returns no update (see its measurements, aggregator/* in metrics.csv: '
             f'zero_result, nonfinite_result), or --server_lr={config.server_lr:g} is too small to change a '
             f'float32 weight')
  return (f'stopped after round {round_num} of {config.rounds}: the model has not changed for {unchanged} rounds '
          f'(rounds {first}-{round_num}) with aggregator {config.aggregator!r}: {cause}. '
          f'--max_frozen_rounds=0 lets such a run go on')
