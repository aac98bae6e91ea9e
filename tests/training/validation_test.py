"""The runner's validation split for tuning (`validation_fraction`): each client holds out a seeded share of its
examples, evaluations are on the pooled held-out examples, and the test split and OOD clients are never read."""

import collections
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import tests
from tff_gma.data import client_data
from tff_gma.data import loaders
from training import config as config_lib
from training.engine import evaluation
from training.runner import experiment

_TOY = config_lib.ExperimentConfig(
    dataset='digits', partition='mixed_skew', num_clients=4, clients_per_round=4, rounds=2, model='logistic',
    batch_size=32, client_lr=0.05, seed=3, validation_fraction=0.2)


def _rows(x, y):
  """Each example as one hashable row (x then y), for multiset comparisons."""
  flat = np.concatenate([np.reshape(x, [len(x), -1]).astype(np.float64), np.reshape(y, [-1, 1])], axis=1)
  return sorted(map(tuple, flat))


def test_hold_out_is_disjoint_from_the_kept_examples_and_covers_each_client():
  # Examples identified by their index (x = index): per client, held-out and kept are disjoint and together are
  # the client's examples; floor(fraction * n) are held out, and at least one example is kept.
  sizes = [1, 4, 5, 23, 100]
  start = np.cumsum([0] + sizes)
  arrays = collections.OrderedDict(
      (f'c{i}', (np.arange(start[i], start[i + 1], dtype=np.float32)[:, None], np.full(n, i, np.int32)))
      for i, n in enumerate(sizes))
  train, held = evaluation.hold_out(client_data.from_client_arrays(arrays), 0.2, seed=7)
  assert train.client_ids == list(arrays)
  for cid, n in zip(arrays, sizes):
    kept = train.client_arrays(cid)[0][:, 0]
    out = held[cid][0][:, 0] if cid in held else np.zeros([0])
    assert len(out) == int(np.floor(0.2 * n)) and len(kept) >= 1
    assert not set(kept) & set(out)
    np.testing.assert_array_equal(np.sort(np.concatenate([kept, out])), arrays[cid][0][:, 0])
  again_train, again_held = evaluation.hold_out(client_data.from_client_arrays(arrays), 0.2, seed=7)
  for cid in held:
    np.testing.assert_array_equal(again_held[cid][0], held[cid][0])
  _, other = evaluation.hold_out(client_data.from_client_arrays(arrays), 0.2, seed=8)
  assert any(not np.array_equal(other[c][0], held[c][0]) for c in held)


def test_a_validation_setup_trains_on_the_rest_and_holds_no_test_data():
  config = _TOY
  setup = experiment.build_setup(config)
  original = loaders.load_federated_data(config.dataset, config.partition, config.num_clients, config.seed,
                                         **config.partition_kwargs())
  val_x, val_y = setup.validation
  assert len(setup.data.test_y) == 0 and len(setup.data.test_x) == 0 and setup.data.ood_test is None
  np.testing.assert_array_equal(setup.evaluator.y, val_y)  # The evaluator holds the validation split only.
  # The examples the clients train on plus the validation examples are exactly the clients' data, none twice.
  kept = [setup.data.train.client_arrays(c) for c in original.train.client_ids]
  assert _rows(np.concatenate([x for x, _ in kept] + [val_x]), np.concatenate([y for _, y in kept] + [val_y])) == \
      _rows(*original.train.pooled_arrays())
  expected = sum(int(np.floor(0.2 * len(original.train.client_arrays(c)[1]))) for c in original.train.client_ids)
  assert len(val_y) == expected > 0


def test_a_validation_run_reports_validation_metrics_and_never_test_ones(tmp_path):
  config = dataclasses.replace(_TOY, output_dir=str(tmp_path / 'run'))
  summary = experiment.run(config, show_progress=False).summary
  rows = experiment._read_rows(str(tmp_path / 'run' / 'metrics.csv'))
  assert [r['round'] for r in rows] == [1, 2]
  keys = set().union(*rows)
  assert {'validation/accuracy', 'validation/loss'} <= keys
  assert not [k for k in keys if k.startswith(('test/', 'ood_test/'))]
  accuracy = [r['validation/accuracy'] for r in rows]
  saved = json.loads((tmp_path / 'run' / 'summary.json').read_text())
  assert saved == json.loads(json.dumps(summary))
  assert saved['final_validation_accuracy'] == pytest.approx(np.mean(accuracy[-experiment.LAST_EVALS_FOR_FINAL:]))
  assert saved['best_validation_accuracy'] == pytest.approx(max(accuracy))
  assert saved['final_accuracy'] is None and saved['best_accuracy'] is None
  assert 'final_ood_accuracy' not in saved
  assert saved['config']['validation_fraction'] == 0.2
  # Resuming it (to more rounds) keeps the split: the same directory continues.
  more = experiment.run(dataclasses.replace(config, rounds=3), show_progress=False).summary
  assert more['rounds_completed'] == 3 and more['best_validation_accuracy'] is not None


@pytest.mark.parametrize('changes, named', [
    ({'validation_fraction': 1.5}, 'validation_fraction'),
    ({'validation_fraction': 1.0}, 'validation_fraction'),
    ({'validation_fraction': -0.1}, 'validation_fraction'),
    ({'validation_fraction': float('nan')}, 'validation_fraction'),
    ({'algorithm': 'personalized', 'aggregator': 'rfa'}, 'validation_fraction: algorithm=personalized'),
    ({'membership_inference': True}, 'validation_fraction: membership_inference'),
])
def test_invalid_validation_settings_are_refused_naming_them(changes, named, tmp_path):
  config = dataclasses.replace(_TOY, output_dir=str(tmp_path / 'never'), **changes)
  with pytest.raises(experiment.ConfigError, match=named):
    experiment.validate(config)
  assert not (tmp_path / 'never').exists()


def test_personalized_and_membership_inference_still_run_without_validation():
  for changes in ({'algorithm': 'personalized', 'aggregator': 'rfa'}, {'membership_inference': True}):
    experiment.validate(dataclasses.replace(_TOY, validation_fraction=0.0, **changes))


def test_an_older_config_without_validation_fraction_resumes_at_zero(tmp_path):
  config = dataclasses.replace(_TOY, validation_fraction=0.0, output_dir=str(tmp_path / 'run'))
  os.makedirs(config.output_dir)
  older = {k: v for k, v in dataclasses.asdict(config).items() if k != 'validation_fraction'}
  (tmp_path / 'run' / 'config.json').write_text(json.dumps(older))
  experiment.check_resumable(config)
  with pytest.raises(experiment.ConfigError, match='validation_fraction: 0.0 -> 0.2'):
    experiment.check_resumable(dataclasses.replace(config, validation_fraction=0.2))


def test_the_runner_refuses_a_validation_fraction_of_one_and_a_half_in_one_line(tmp_path):
  process = subprocess.run(
      [sys.executable, '-m', 'training.run', f'--output_dir={tmp_path / "out"}', '--rounds=1', '--model=logistic',
       '--validation_fraction=1.5'],
      cwd=tests.ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
  assert process.returncode != 0
  assert 'Traceback' not in process.stderr + process.stdout, process.stderr[-3000:]
  # absl prints the usage first, as for every flag error; the error itself is one line.
  errors = [line for line in process.stderr.splitlines() if line.startswith('invalid flags: ')]
  assert len(errors) == 1 and 'validation_fraction must lie in [0, 1)' in errors[0] and '1.5' in errors[0], \
      process.stderr[-2000:]
  assert not (tmp_path / 'out').exists()


def test_the_validation_split_is_taken_before_data_corruption_poisons_the_rest():
  # Corrupted clients train on poisoned data, but what they hold out for validation is their clean data.
  config = dataclasses.replace(_TOY, partition='iid', corruption='data_flip_labels', corrupt_fraction=0.5)
  setup = experiment.build_setup(config)
  clean = experiment.build_setup(dataclasses.replace(config, corruption='none', corrupt_fraction=0.0))
  np.testing.assert_array_equal(setup.validation[1], clean.validation[1])
  np.testing.assert_array_equal(setup.validation[0], clean.validation[0])
  poisoned = [c for c in setup.data.train.client_ids
              if not np.array_equal(setup.data.train.client_arrays(c)[1], clean.data.train.client_arrays(c)[1])]
  assert len(poisoned) == 2 and set(poisoned) == set(setup.corrupted)
