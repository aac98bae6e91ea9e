"""The watch of a run's model weights: unchanged bit for bit, the rounds in a row, the count a resumed run reads back,
and the line that stops the run."""

import dataclasses

import numpy as np

from training import config as config_lib
from training.runner import frozen_model

_CONFIG = config_lib.ExperimentConfig(rounds=20, aggregator='rfa', client_lr=0.05, server_lr=1.0)


def test_weights_are_the_same_only_bit_for_bit():
  a = [np.array([[1.0, 0.0]], np.float32), np.array([2.0], np.float32)]
  assert frozen_model.same_bits(a, [t.copy() for t in a])
  assert not frozen_model.same_bits(a, [a[0], np.array([2.0000002], np.float32)])  # One float32 step apart.
  assert not frozen_model.same_bits(a, [np.array([[1.0, -0.0]], np.float32), a[1]])  # -0.0 == 0.0, but moved.
  assert not frozen_model.same_bits(a, [a[0], a[1].astype(np.float64)])
  assert not frozen_model.same_bits(a, [a[0].reshape(2), a[1]])
  assert not frozen_model.same_bits(a, a[:1])
  nan = [np.array([np.nan], np.float32)]
  assert frozen_model.same_bits(nan, [nan[0].copy()])  # A NaN that stays is a model that did not move.


def test_the_unchanged_rounds_in_a_row_count_up_and_a_moved_round_resets_them():
  watch = frozen_model.FrozenModel([np.zeros(3, np.float32)])
  assert [watch.update([np.zeros(3, np.float32)]) for _ in range(3)] == [1, 2, 3]
  assert watch.update([np.ones(3, np.float32)]) == 0
  assert watch.update([np.ones(3, np.float32)]) == 1
  resumed = frozen_model.FrozenModel([np.ones(3, np.float32)], unchanged=2)  # Counting on from a checkpoint.
  assert resumed.update([np.ones(3, np.float32)]) == 3


def test_a_resumed_run_reads_the_count_of_its_checkpoints_round_from_metrics_csv(tmp_path):
  csv_path = tmp_path / 'metrics.csv'
  assert frozen_model.resumed_unchanged(str(csv_path), 3) == 0  # No file yet.
  csv_path.write_text(f'round,client_work/train/loss,{frozen_model.COLUMN}\n1,0.5,\n2,0.5,1.0\n3,0.5,2.0\n4,0.4,\n')
  assert [frozen_model.resumed_unchanged(str(csv_path), r) for r in (0, 1, 2, 3, 4, 5)] == [0, 0, 1, 2, 0, 0]


def test_the_stop_names_the_rounds_and_the_aggregator_as_given_and_the_likely_cause():
  line = frozen_model.stop_message(_CONFIG, 7, 5, all_clients_dropped=False)
  assert line.startswith("stopped after round 7 of 20: the model has not changed for 5 rounds (rounds 3-7) with "
                         "aggregator 'rfa': likely the aggregator returns no update (see its measurements")
  assert '--server_lr=1 ' in line and line.endswith('--max_frozen_rounds=0 lets such a run go on')
  assert '\n' not in line
  dropped = frozen_model.stop_message(dataclasses.replace(_CONFIG, client_lr=1e38, aggregator='gma'), 3, 3, True)
  assert "(rounds 1-3) with aggregator 'gma': every client was dropped as non-finite" in dropped
  assert '--client_lr=1e+38' in dropped



def test_an_aggregator_that_flags_no_update_counts_as_unchanged():
  """An adaptive server optimizer moves the model on its momentum while the aggregator returns zeros: its flags
  (`zero_result`, `nonfinite_result`) count the round as one that trained nothing."""
  assert frozen_model.aggregator_returned_no_update({'aggregator/zero_result': 1.0, 'aggregator/x': 3.0})
  assert frozen_model.aggregator_returned_no_update({'aggregator/mean/nonfinite_result': 1})
  assert not frozen_model.aggregator_returned_no_update({'aggregator/zero_result': 0.0, 'loss': 1.0})
  watch = frozen_model.FrozenModel([np.zeros(3, np.float32)])
  assert watch.update([np.ones(3, np.float32)], no_update=True) == 1
  assert watch.update([np.full(3, 2.0, np.float32)], no_update=False) == 0
