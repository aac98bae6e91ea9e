"""The runner on every --dataset and every --partition, at toy size, with no network.

The downloadable data sets are served by the fakes their loaders are tested with: `tfds.testing.mock_data` for
the TFDS images, TFF's synthetic client data in place of TFF's EMNIST/Shakespeare downloads.
"""

import dataclasses

import pytest
import tensorflow_datasets as tfds
import tensorflow_federated as tff

from training import config as config_lib
from training.runner import experiment

_TOY = config_lib.ExperimentConfig(rounds=1, num_clients=3, clients_per_round=3, batch_size=16, model='cnn',
                                   seed=1)


def _tff_loader(synthetic):
  return lambda **kwargs: (synthetic(), synthetic())


@pytest.mark.parametrize('dataset, partition, model', [
    ('mnist', 'label_skew', 'lenet'),
    ('fashion_mnist', 'mixed_skew', 'cnn'),
    ('cifar10', 'dirichlet', 'cnn'),
    ('cifar100', 'quantity_skew', 'cnn'),
])
def test_tfds_datasets_run(dataset, partition, model, tmp_path):
  # TFDS's (mocked) copy, also for fashion_mnist: asked for with fashion_mnist_source=tfds (else its IDX files).
  source = {'fashion_mnist_source': 'tfds'} if dataset == 'fashion_mnist' else {}
  config = dataclasses.replace(_TOY, dataset=dataset, partition=partition, model=model,
                               data_dir=str(tmp_path / 'tfds'), output_dir=str(tmp_path / 'run'), **source)
  with tfds.testing.mock_data(num_examples=60):
    summary = experiment.run(config, show_progress=False).summary
  assert summary['rounds_completed'] == 1 and summary['final_accuracy'] is not None


def test_emnist_by_writer_runs(monkeypatch, tmp_path):
  monkeypatch.setattr(tff.simulation.datasets.emnist, 'load_data',
                      _tff_loader(tff.simulation.datasets.emnist.get_synthetic))
  config = dataclasses.replace(_TOY, dataset='emnist', partition='by_writer', model='emnist_cnn', num_clients=1,
                               clients_per_round=1, output_dir=str(tmp_path / 'run'))
  summary = experiment.run(config, show_progress=False).summary
  assert summary['rounds_completed'] == 1


def test_shakespeare_runs(monkeypatch, tmp_path):
  monkeypatch.setattr(tff.simulation.datasets.shakespeare, 'load_data',
                      _tff_loader(tff.simulation.datasets.shakespeare.get_synthetic))
  config = dataclasses.replace(_TOY, dataset='shakespeare', partition='by_writer', model='char_lstm', num_clients=1,
                               clients_per_round=1, batch_size=2, client_momentum=0.0, client_lr=0.5,
                               output_dir=str(tmp_path / 'run'))
  summary = experiment.run(config, show_progress=False).summary
  assert summary['rounds_completed'] == 1
  assert 0.0 <= summary['final_accuracy'] <= 1.0


@pytest.mark.parametrize('partition', ['iid', 'label_skew', 'dirichlet', 'quantity_skew', 'feature_skew',
                                       'mixed_skew'])
def test_every_digits_partition_runs(partition, tmp_path):
  config = dataclasses.replace(_TOY, partition=partition, model='logistic', output_dir=str(tmp_path / 'run'))
  summary = experiment.run(config, show_progress=False).summary
  assert summary['rounds_completed'] == 1
  if partition in ('feature_skew', 'mixed_skew'):
    assert 'final_ood_accuracy' in summary
