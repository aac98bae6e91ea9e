"""Tests of the GMA claims study (training.studies.gma_fmnist_claims) and of colored MNIST's shared colouring.

The study's protocol and read-back run on fake runs (summaries and curves made up here, no training); the
construction's properties are checked on the images themselves (the colour read back from the pixels).
"""

import numpy as np
import pytest

from tff_gma.data import colored
from tff_gma.data import federated
from training.runner import experiment
from training.studies import gma_fmnist_claims as claims
from training.studies.shared import study_runs

T_975_DF4 = 2.7764451051977987  # Student t, 97.5% quantile, 4 degrees of freedom (tables).


def test_every_cell_and_method_validates():
  study = claims.Study(list(claims.SETTINGS), [], claims.TUNE_SEEDS, claims.FINAL_SEEDS, '/tmp/unused')
  for setting, cell in claims.SETTINGS.items():
    for method in cell.methods:
      mu = claims.FEDPROX_MU if method.algorithm == 'fedprox' else None
      config = study.config(claims.Run(setting, method.algorithm, method.aggregator, 0.01, 1.0, 0.4, mu, 0, True))
      experiment.validate(config)
      assert config.adaptive_optimizer == 'reddi'
      assert config.dataset == 'fashion_mnist'
      if method.algorithm == 'fedprox':
        assert config.proximal_strength == mu
  assert claims.SETTINGS['cfm10_feature'].config['partition'] == 'feature_skew_shared'
  assert claims.SETTINGS['cfm100_mixed'].config['partition'] == 'mixed_skew_shared'
  assert [claims.SETTINGS[f'epochs{e}'].config['local_epochs'] for e in (1, 3, 5, 10, 20)] == [1, 3, 5, 10, 20]


def test_the_ten_client_cells_and_only_they_train_the_stated_subset():
  study = claims.Study(list(claims.SETTINGS), [], claims.TUNE_SEEDS, claims.FINAL_SEEDS, '/tmp/unused')
  for setting, cell in claims.SETTINGS.items():
    method = cell.methods[0]
    fractions = {study.config(claims.Run(setting, method.algorithm, method.aggregator, 0.01, 1.0, 0.4, None, seed,
                                         tuning)).train_subset_fraction
                 for seed in (0, 7) for tuning in (True, False)}
    ten_clients = cell.config['num_clients'] == 10
    assert fractions == {claims.TEN_CLIENT_SUBSET if ten_clients else 1.0}, setting
  assert claims.TEN_CLIENT_SUBSET == 0.1
  assert sum(s.config['num_clients'] == 10 for s in claims.SETTINGS.values()) == 7  # cfm10_* and epochs*.


def test_paper_tables_have_their_shape_and_the_issues_numbers():
  assert sorted(claims.PAPER_TABLE3) == sorted((m, n) for m in ('Yes', 'No') for n in (500, 100, 10))
  for row in claims.PAPER_TABLE3.values():
    assert sorted(row) == ['fedadam', 'fedavg', 'fedprox', 'fedyogi']
    for avg, gma in row.values():
      assert len(avg) == len(gma) == 2 and 80 < avg[0] < 95 and 80 < gma[0] < 95 and 0 <= avg[1] < 1
  # The issue quotes these (FedAvg, mixed skew): 100 clients 85.62 -> 88.32, 10 clients 86.77 -> 89.17.
  assert claims.paper_numbers('cfm100_mixed', 'fedavg') == (85.62, 88.32)
  assert claims.paper_numbers('cfm10_mixed', 'fedavg') == (86.77, 89.17)
  assert claims.PAPER_TABLE9 == {3: (89.91, 91.73), 5: (85.71, 87.29), 10: (84.13, 87.11), 20: (80.27, 86.66)}
  assert claims.paper_numbers('epochs1', 'fedavg') is None  # Table 9 has no E = 1 column.


# ------------------------------------------------------------------------------------------------------------------
# The shared colouring.


def _colour_ids(images: np.ndarray, colors: np.ndarray) -> np.ndarray:
  """Each image's colour id, read from its brightest pixel (the colour at full value: that pixel over its max)."""
  flat = images.reshape(len(images), -1, 3)
  brightest = flat[np.arange(len(images)), flat.sum(-1).argmax(1)]
  unit = brightest / brightest.max(-1, keepdims=True)
  return np.abs(unit[:, None, :] - colors[None]).sum(-1).argmin(1)


def _grey(num: int, seed: int):
  rng = np.random.default_rng(seed)
  x = rng.uniform(0.2, 1.0, size=(num, 4, 4, 1)).astype(np.float32)
  return x, rng.integers(0, 10, size=num).astype(np.int64)


def test_shared_colouring_one_train_mapping_derangements_for_test():
  coloring = colored.Coloring.create_shared(6, 4, 10, np.random.default_rng(0))
  train = coloring.train_mappings
  assert train.shape == (6, 10) and (train == train[0]).all() and sorted(train[0]) == list(range(10))
  np.testing.assert_allclose(coloring.train_correlations, np.linspace(0.9, 0.8, 6))
  assert len({tuple(m) for m in coloring.test_mappings}) == 4
  for mapping in coloring.test_mappings:
    assert sorted(mapping) == list(range(10)) and (mapping != train[0]).all()
  again = colored.Coloring.create_shared(6, 4, 10, np.random.default_rng(0))
  assert (again.test_mappings == coloring.test_mappings).all() and (again.train_mappings == train).all()
  with pytest.raises(ValueError, match='derangements'):
    colored.distinct_derangements(2, np.arange(2), np.random.default_rng(0))  # Only one derangement of 2 exists.


@pytest.mark.parametrize('partition', federated.SHARED_COLOR_PARTITIONS)
def test_shared_partitions_colour_by_label_in_training_and_never_so_out_of_distribution(partition):
  x, y = _grey(600, 1)
  x_test, y_test = _grey(200, 2)
  fd = federated.from_arrays('toy', x, y, x_test, y_test, num_classes=10, partition=partition, num_clients=4,
                             seed=3, classes_per_client=2, num_test_clients=2, train_correlation=(1.0, 1.0),
                             test_correlation=1.0)
  colors = colored.palette(10)
  mapping = {}
  for client in fd.train.client_ids:
    cx, cy = fd.train.client_arrays(client)
    ids = _colour_ids(cx, colors)
    for label, colour in zip(cy, ids):  # One colour per class, the same at every client.
      assert mapping.setdefault(label, colour) == colour
    if partition == 'mixed_skew_shared':
      assert len(set(cy)) <= 2
  assert len(set(mapping.values())) == len(mapping)
  ood_ids = _colour_ids(fd.ood_test_x, colors)
  assert all(mapping.get(label, -1) != colour for label, colour in zip(fd.ood_test_y, ood_ids))
  test_ids = _colour_ids(fd.test_x, colors)  # In distribution: the training colours.
  assert all(mapping[label] == colour for label, colour in zip(fd.test_y, test_ids) if label in mapping)


def test_shared_partition_correlations_differ_by_client_and_are_deterministic():
  x, y = _grey(4000, 4)
  x_test, y_test = _grey(100, 5)
  kwargs = dict(num_classes=10, partition='feature_skew_shared', num_clients=2, train_correlation=(0.6, 0.95))
  fd = federated.from_arrays('toy', x, y, x_test, y_test, seed=7, **kwargs)
  colors = colored.palette(10)
  ids = {c: _colour_ids(fd.train.client_arrays(c)[0], colors) for c in fd.train.client_ids}
  labels = {c: fd.train.client_arrays(c)[1] for c in fd.train.client_ids}
  # The shared mapping: each class's most frequent colour over both clients.
  pooled_y, pooled_ids = np.concatenate(list(labels.values())), np.concatenate(list(ids.values()))
  shared = np.array([np.bincount(pooled_ids[pooled_y == k], minlength=10).argmax() for k in range(10)])
  agreement = [np.mean(ids[c] == shared[labels[c]]) for c in fd.train.client_ids]
  assert abs(agreement[0] - 0.95) < 0.03 and abs(agreement[1] - 0.6) < 0.04
  again = federated.from_arrays('toy', x, y, x_test, y_test, seed=7, **kwargs)
  assert np.array_equal(again.train.pooled_arrays()[0], fd.train.pooled_arrays()[0])
  assert np.array_equal(again.ood_test_x, fd.ood_test_x)
  other = federated.from_arrays('toy', x, y, x_test, y_test, seed=8, **kwargs)
  assert not np.array_equal(other.ood_test_x, fd.ood_test_x)


# ------------------------------------------------------------------------------------------------------------------
# The protocol and the read-back, on fake runs.


def _fake_score(run: claims.Run) -> float:
  """Peaks at client lr 0.05, server lr 1.5 (adaptive: 0.01), mu 0.1 and tau 0.6; the seed adds a little."""
  score = 0.8 - abs(run.client_lr - 0.05) - 0.01 * abs(run.server_lr - (1.5 if run.server_lr > 0.5 else 0.01))
  score -= 0.0 if run.mu is None else 0.01 * abs(np.log10(run.mu) + 1)
  return score - 0.01 * abs(run.tau - 0.6) + 0.001 * run.seed


class FakeStudy(claims.Study):
  """Runs 'finish' when `finish_all` says so; their summaries and curves are made up."""

  def __init__(self, settings, **kwargs):
    super().__init__(settings, [], (0, 1), (2, 3, 4, 5, 6), '/tmp/fake', **kwargs)
    self.finished = set()

  def summary(self, run):
    return {'best_validation_accuracy': _fake_score(run)} if run.name in self.finished else None

  def finish_all(self, missing=()):
    while True:
      runs, _ = self.runnable('all')
      new = {r.name for r in runs if r.name not in missing} - self.finished
      if not new:
        return runs
      self.finished |= new


def test_fedprox_tunes_mu_then_tau_and_cells_take_their_sources_choices():
  study = FakeStudy(['cfm10_feature', 'epochs20'])
  study.finish_all()
  _, chosen, found = study.tuned('cfm10_feature', claims.Method('fedprox', 'gma'))
  assert chosen == claims.Point(0.05, 1.5, 0.6, 0.1) and found['grid_winner']['mu'] == claims.FEDPROX_MU
  _, chosen, _ = study.tuned('cfm10_feature', claims.Method('fedavg', 'mean'))
  assert chosen == claims.Point(0.05, 1.5, 0.4, None)
  # E = 20 takes E = 1's learning rates (tau 0.4 for the fixed variant, tuned for the other), checked locally.
  _, fixed, found = study.tuned('epochs20', claims.Method('fedavg', 'gma', claims.TAU_FIXED))
  _, tuned, _ = study.tuned('epochs20', claims.Method('fedavg', 'gma'))
  assert fixed == claims.Point(0.05, 1.5, 0.4, None) and tuned == claims.Point(0.05, 1.5, 0.6, None)
  assert found['from'] == 'epochs1' and found['check']['same_learning_rates']
  finals = [r for r in study.runnable('final')[0] if r.setting == 'epochs20']
  assert sorted({r.seed for r in finals}) == list(claims.FINAL_SEEDS_LONG_EPOCHS)
  # Runs of E = 1's tuning are scheduled for epochs20 although epochs1 is not among the study's settings.
  assert any(r.setting == 'epochs1' and r.tuning for r in study.runnable('tune')[0])


def test_collect_reports_whole_cells_only_and_pairs_seeds(monkeypatch):
  study = FakeStudy(['cfm100_feature'])
  runs = study.finish_all()
  def curve(output_dir, key):  # GMA 2 points above AVG on the OOD clients, seed-dependent; equal in distribution.
    seed = int(output_dir.rsplit('seed', 1)[1])
    lift = 0.02 * (1 + 0.1 * seed) if '-gma-' in output_dir and key.startswith('ood') else 0.0
    return [0.5 + 0.01 * i + lift for i in range(12)]
  monkeypatch.setattr(study_runs, 'curve', curve)
  records = claims.collect(study)
  assert len(records) == len(claims.OOD_METHODS)
  rows = claims.comparisons(records)
  fedavg = next(r for r in rows if r['method'] == 'fedavg/gma')
  diff = np.array([2.0 * (1 + 0.1 * s) for s in claims.FINAL_SEEDS])
  half = T_975_DF4 * diff.std(ddof=1) / np.sqrt(len(diff))
  assert fedavg['ood_last10']['mean'] == pytest.approx(diff.mean())
  assert fedavg['ood_last10']['low'] == pytest.approx(diff.mean() - half, rel=1e-4)  # The study's t: 4 digits.
  assert fedavg['ood_last10']['verdict'] == 'GMA ahead' and fedavg['paper'] == (89.88, 91.37)
  assert fedavg['test_best']['mean'] == pytest.approx(0.0)
  table = claims.side_by_side(rows, 'cfm100_feature')
  assert '| fedavg/gma | 89.88 -> 91.37 |' in table and table.rstrip().endswith('61.00 -> 61.00; 56.50 -> 56.50 |')
  # One final run missing: the cell is not reported at all.
  partial = FakeStudy(['cfm100_feature'])
  missing = [r.name for r in runs if not r.tuning][:1]
  partial.finish_all(missing)
  assert not claims.collect(partial)
