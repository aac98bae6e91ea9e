"""Datasets built in the TFF worker from files: the same batches as the datasets sent from Python, so the same
runs bit for bit; where it applies; private files removed after the run."""

import dataclasses
import os
import stat

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from training import config as config_lib
from training.engine import client_pipeline
from training.engine import methods
from training.engine import worker_datasets
from training.runner import experiment
from training.runner import round_loop
from tff_gma.data import client_data

_TOY = config_lib.ExperimentConfig(
    dataset='digits', partition='label_skew', num_clients=4, clients_per_round=3, rounds=3, model='logistic',
    batch_size=8, client_lr=0.05, seed=0, local_epochs=2, participation_eval=False)


def _weights(result):
  w = result.model_weights
  return [np.asarray(t) for t in list(w.trainable) + list(w.non_trainable)]


def _batches(dataset):
  return [tuple(np.asarray(v) for v in tf.nest.flatten(b)) for b in dataset]


@pytest.mark.parametrize('global_seed', [0, 5])
def test_round_pipeline_takes_the_batches_tf_data_shuffle_takes(global_seed):
  # The pipeline's shuffle is the op Dataset.shuffle builds, with the seed pair it would take: same batches, same
  # order, reshuffled each epoch (what every run before the pipeline existed trained on).
  examples = tf.data.Dataset.from_tensor_slices(
      {'x': np.arange(50, dtype=np.float32).reshape(25, 2), 'y': np.arange(25, dtype=np.int32)})
  tf.random.set_seed(global_seed)
  expected = _batches(examples.shuffle(10_000, seed=1234, reshuffle_each_iteration=True).repeat(3).batch(4))
  ours = _batches(client_pipeline.round_pipeline(examples, *round_loop.shuffle_seeds(1234), local_epochs=3,
                                                 batch_size=4))
  assert len(ours) == len(expected) == 19
  for a, b in zip(ours, expected):
    for u, v in zip(a, b):
      np.testing.assert_array_equal(u, v)
  epochs = np.concatenate([b[1] for b in ours]).reshape(3, 25)
  assert all(sorted(e) == list(range(25)) for e in epochs) and not np.array_equal(epochs[0], epochs[1])


@pytest.mark.parametrize('algorithm,aggregator', [('fedavg', 'mean'), ('fedavg', 'gma'), ('fedavg', 'rfa'),
                                                  ('fedprox', 'mean'), ('fedadam', 'mean'), ('fedadam', 'gma')])
def test_worker_datasets_train_exactly_as_sent_datasets(tmp_path, algorithm, aggregator):
  results = {}
  for placement in worker_datasets.PLACEMENTS:
    config = dataclasses.replace(_TOY, algorithm=algorithm, aggregator=aggregator, dataset_placement=placement,
                                 server_lr=0.01 if algorithm == 'fedadam' else 1.0,
                                 output_dir=str(tmp_path / placement))
    results[placement] = experiment.run(config, show_progress=False)
    assert results[placement].summary['dataset_placement'] == placement
  for a, b in zip(_weights(results['worker']), _weights(results['driver'])):
    np.testing.assert_array_equal(a, b)  # Bit for bit: the same batches through the same computation.


def test_a_run_resumes_across_placements_bit_exactly(tmp_path):
  straight = experiment.run(dataclasses.replace(_TOY, rounds=4, output_dir=str(tmp_path / 'a')), show_progress=False)
  config = dataclasses.replace(_TOY, rounds=2, output_dir=str(tmp_path / 'b'), dataset_placement='driver')
  experiment.run(config, show_progress=False)
  resumed = experiment.run(dataclasses.replace(config, rounds=4, dataset_placement='worker'), show_progress=False)
  for a, b in zip(_weights(straight), _weights(resumed)):
    np.testing.assert_array_equal(a, b)


def test_placement_falls_back_where_the_worker_cannot_build_the_datasets(tmp_path):
  summary = experiment.run(dataclasses.replace(_TOY, algorithm='scaffold', output_dir=str(tmp_path / 'run'), rounds=1),
                           show_progress=False).summary
  assert summary['dataset_placement'] == 'driver'
  data = client_data.from_partition(np.zeros((4, 2), np.float32), np.zeros(4, np.int32), [[0, 1], [2, 3]])
  plain = dict(algorithm='fedadam', aggregator='gma', corruption='none', client_execution='worker', workers=None,
               train=data)
  assert worker_datasets.applies(**plain) is None
  assert 'workers' in worker_datasets.applies(**{**plain, 'workers': 'host:8000'})
  assert 'FedAvg family' in worker_datasets.applies(**{**plain, 'algorithm': 'scaffold'})
  assert 'FedAvg family' in worker_datasets.applies(**{**plain, 'aggregator': 'elastic'})
  assert 'itself' in worker_datasets.applies(**{**plain, 'client_execution': 'local'})
  assert 'itself' in worker_datasets.applies(**{**plain, 'corruption': 'gaussian'})
  assert 'arrays' in worker_datasets.applies(**{**plain, 'train': object()})
  with pytest.raises(ValueError, match='built for datasets sent'):
    methods.Method(None).place_datasets_in_worker(None)
  with pytest.raises(ValueError, match='place_datasets_in_worker first'):
    methods.Method(None, client_sources=object()).run_round(None, [], [], 1)


def test_files_are_private_and_removed_on_close():
  x = np.arange(12, dtype=np.float32).reshape(6, 2)
  data = client_data.from_partition(x, np.arange(6, dtype=np.int32), [[0, 1, 2], [3, 4, 5]])
  placement = worker_datasets.WorkerDatasets(round_loop.ClientInputs(data, 2, 1, 2, seed=0))
  directory = placement.directory
  assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
  assert sorted(os.listdir(directory)) == ['0.x', '0.y', '1.x', '1.y']
  np.testing.assert_array_equal(
      tf.io.parse_tensor(tf.io.read_file(os.path.join(directory, '1.x')), tf.float32).numpy(), x[3:])
  (source,) = placement.sources(['client_001'], round_num=4)
  element = source.get_single_element()
  seeds = round_loop.shuffle_seeds(round_loop.client_seed(0, 4, 1))
  assert element['prefix'].numpy().decode() == os.path.join(directory, '1')
  assert (int(element['seed']), int(element['seed2'])) == seeds
  placement.close()
  assert not os.path.exists(directory)


def test_the_worker_iterates_the_batches_python_built():
  # The clients' dataset building, run alone: in the worker, each client's batches (every example, in order)
  # are those of the dataset ClientInputs builds in Python for the round. (Compared inside the worker: a sequence
  # returned to Python is re-serialized by TFF and reshuffled on the way.)
  from tff_gma import runtime  # pylint: disable=g-import-not-at-top
  runtime.set_simulation_context()
  rng = np.random.default_rng(0)
  data = client_data.from_partition(rng.normal(size=(30, 3)).astype(np.float32),
                                    rng.integers(0, 5, 30).astype(np.int32), [np.arange(0, 13), np.arange(13, 30)])
  tf.random.set_seed(0)  # As seeded_initial_state leaves it.
  inputs = round_loop.ClientInputs(data, 2, 2, 4, seed=7)
  placement = worker_datasets.WorkerDatasets(inputs)
  try:
    ids, datasets = inputs(3)
    sequence = tff.SequenceType(tff.types.tensorflow_to_type(datasets[0].element_spec))

    def walk(dataset):  # Every batch's examples and its size, in the order the client work takes them.
      return dataset.reduce((tf.zeros([0, 3]), tf.zeros([0], tf.int32), tf.zeros([0], tf.int32)),
                            lambda s, b: (tf.concat([s[0], b['x']], 0), tf.concat([s[1], b['y']], 0),
                                          tf.concat([s[2], tf.shape(b['y'])], 0)))

    walk_sent = tff.tensorflow.computation(walk, sequence)
    sent = tff.federated_computation(lambda d: tff.federated_map(walk_sent, d),
                                     tff.FederatedType(sequence, tff.CLIENTS))
    sources = placement.client_sources
    walk_source = tff.tensorflow.computation(lambda s: walk(sources.dataset(s)), sources.source_type)
    built = tff.federated_computation(lambda s: tff.federated_map(walk_source, s),
                                      tff.FederatedType(sources.source_type, tff.CLIENTS))
    for ours, theirs, size in zip(built(placement.sources(ids, 3)), sent(list(datasets)), (13, 17)):
      assert len(ours[1]) == 2 * size and list(ours[2][:-1]) == [4] * (len(ours[2]) - 1)
      for u, v in zip(ours, theirs):
        np.testing.assert_array_equal(u, v)
  finally:
    placement.close()


def test_a_sparse_eval_every_can_still_evaluate_each_of_the_last_rounds(tmp_path):
  config = dataclasses.replace(_TOY, rounds=9, eval_every=4, eval_last_rounds=3, local_epochs=1,
                               output_dir=str(tmp_path / 'run'))
  experiment.run(config, show_progress=False)
  rows = experiment._read_rows(str(tmp_path / 'run' / 'metrics.csv'))  # pylint: disable=protected-access
  assert [int(r['round']) for r in rows if 'test/accuracy' in r] == [4, 7, 8, 9]
  with pytest.raises(experiment.ConfigError, match='eval_last_rounds'):
    experiment.validate(dataclasses.replace(config, eval_last_rounds=-1))


def test_a_round_too_large_for_memory_is_refused_in_one_line():
  x = np.zeros((10, 1000), np.float32)  # 40,000 bytes a client.
  data = client_data.from_partition(x, np.zeros(10, np.int32), [np.arange(0, 5), np.arange(5, 10)])
  worker_datasets.check_memory(data, 2, available=10**6)
  with pytest.raises(ValueError, match='clients_per_round=2: a round .* more than the 0 MiB'):
    worker_datasets.check_memory(data, 2, available=2 * 3 * 20_000 - 1)
  assert worker_datasets._available_bytes() > 0  # pylint: disable=protected-access


@pytest.mark.parametrize('model,dataset', [('cnn', 'digits'), ('lenet', 'fashion_mnist')])
def test_cnn_and_lenet_train_exactly_as_with_sent_datasets(tmp_path, model, dataset):
  if dataset == 'fashion_mnist' and not os.path.exists('/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz'):
    pytest.skip('Fashion-MNIST is not installed (scripts/setup.sh --data=fashion_mnist)')
  results = {}
  for placement in worker_datasets.PLACEMENTS:
    config = dataclasses.replace(_TOY, model=model, dataset=dataset, algorithm='fedadam', aggregator='gma',
                                 server_lr=0.01, rounds=2, local_epochs=1, batch_size=16,
                                 num_clients=500 if dataset == 'fashion_mnist' else 4,
                                 dataset_placement=placement, output_dir=str(tmp_path / placement))
    results[placement] = experiment.run(config, show_progress=False)
  for a, b in zip(_weights(results['worker']), _weights(results['driver'])):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('sizes,local_epochs,batch_size', [((13, 17), 2, 4), ((1, 6), 3, 4), ((5, 9), 1, 16)])
def test_batches_from_sources_are_the_datasets_batches(sizes, local_epochs, batch_size):
  # `ClientSources.batches` (indices shuffled, examples gathered) against the dataset built from the same source,
  # read batch by batch (`in_graph.read_batches`): the same examples, order and batch boundaries, including a
  # client of one example, a client smaller than a batch and batches that cross an epoch's end.
  from tff_gma.learning import in_graph  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(1)
  total = sum(sizes)
  data = client_data.from_partition(rng.normal(size=(total, 2, 3)).astype(np.float32),
                                    rng.integers(0, 5, total).astype(np.int32),
                                    [np.arange(0, sizes[0]), np.arange(sizes[0], total)])
  placement = worker_datasets.WorkerDatasets(round_loop.ClientInputs(data, 2, local_epochs, batch_size, seed=3))
  try:
    sources = placement.client_sources
    # In a graph, as in the client's computation (TensorArray reads of datasets are graph code there).
    both = tf.function(lambda source: (sources.batches(source), in_graph.read_batches(sources.dataset(source))))
    for source, size in zip(placement.sources(list(data.client_ids), 2), sizes):
      (examples, offsets), (expected, expected_offsets) = both(source)
      assert offsets.numpy()[-1] == size * local_epochs
      np.testing.assert_array_equal(offsets, expected_offsets)
      for leaf in ('x', 'y'):
        np.testing.assert_array_equal(examples[leaf], expected[leaf])
  finally:
    placement.close()
