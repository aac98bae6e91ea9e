"""A round's client datasets built inside the TFF worker, from files written once, instead of sent every round.

A dataset handed to a TFF computation is serialized and sent every round; here only a file prefix and a seed pair
cross per client, and the worker builds the same dataset bit for bit (`client_pipeline`). For the FedAvg family's
own client work in the worker only (`applies`). docs/experiments.md#client-datasets-built-in-the-worker; what it
saves: docs/research/benchmark.md"""

from __future__ import annotations

import atexit
import collections
import os
import shutil
import tempfile
import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import psutil
import tensorflow as tf
import tensorflow_federated as tff

from training.engine import client_pipeline
from training.engine import corruption as corruption_lib
from training.engine import methods

WORKER = 'worker'
DRIVER = 'driver'
PLACEMENTS = (WORKER, DRIVER)


def applies(*, algorithm: str, aggregator: str, corruption: str, client_execution: str, workers: Optional[str],
            train) -> Optional[str]:
  """None when a run's datasets can be built in the worker, else why not (one line for the log)."""
  if workers:
    return 'the clients train on --workers, which do not read this machine\'s files'
  refusal = methods.client_sources_refusal(algorithm, aggregator, corruption in corruption_lib.UPDATE_CORRUPTIONS,
                                           client_execution)
  if refusal is not None:
    return refusal
  if not hasattr(train, 'client_arrays'):
    return 'its client data does not hold its examples as arrays'
  return None


# Copies of a client's examples the worker holds while it trains the client: the file's bytes, the parsed tensor,
# the shuffle buffer, and with the in-graph client loop the batches read into tensors and their concatenation. Not
# all at once: the worker's peak memory stays under 3 copies a client with either loop.
COPIES_PER_CLIENT = 3


def _available_bytes() -> int:
  """Memory available to start new work without swapping (the kernel's MemAvailable)."""
  return psutil.virtual_memory().available


def check_memory(train, clients_per_round: int, available: Optional[int] = None) -> None:
  """Raises ValueError (one line) when a round of the largest clients would not fit in this machine's memory, rather
  than let the worker swap or be killed."""
  largest = max(sum(a.nbytes for a in train.client_arrays(c)) for c in train.client_ids)
  need = largest * COPIES_PER_CLIENT * clients_per_round
  available = _available_bytes() if available is None else available
  if need > available:
    raise ValueError(f'clients_per_round={clients_per_round}: a round of clients of up to {largest / 2**20:.0f} MiB '
                     f'of examples needs about {need / 2**20:.0f} MiB in the TFF worker, more than the '
                     f'{available / 2**20:.0f} MiB this machine has available; use fewer clients per round or more '
                     f'clients (smaller ones)')


@dataclasses.dataclass(frozen=True)
class ClientSources:
  """What a client computation needs to build a round's dataset from a source (file prefix, seed pair) in its own
  graph: the examples' structure and the round's pipeline settings. The same for every run of a model, data
  shape and pipeline (the files are the sources' values), so processes built with it are cached as others are."""
  element_spec: Any
  local_epochs: int
  batch_size: int

  @property
  def key(self) -> tuple:
    """A hashable identity (for process caches)."""
    return (repr(self.element_spec), self.local_epochs, self.batch_size)

  @property
  def source_type(self) -> tff.SequenceType:
    """A client's data: a sequence of one (prefix, seed, seed2) element (TFF's client works take sequences)."""
    return tff.SequenceType(tff.StructType([('prefix', np.str_), ('seed', np.int64), ('seed2', np.int64)]))

  def dataset(self, sources: tf.data.Dataset) -> tf.data.Dataset:
    """The round's dataset of a client's `sources` (TF code for the client's graph): the files' examples,
    through `client_pipeline.round_pipeline` with the seed pair."""
    source = sources.get_single_element()
    examples = tf.data.Dataset.from_tensor_slices(self._examples(source))
    return client_pipeline.round_pipeline(examples, source['seed'], source['seed2'], local_epochs=self.local_epochs,
                                          batch_size=self.batch_size)

  def batches(self, sources: tf.data.Dataset) -> tuple[Any, tf.Tensor]:
    """`in_graph.read_batches(self.dataset(sources))`, computed without walking the examples through tf.data.

    The shuffle's order depends only on the element count and the seeds, never on the elements: the round's
    shuffle runs over the example indices, its epochs are read as one tensor, one gather takes the examples in that
    order, and the batches' boundaries are every `batch_size` examples of the epochs' stream (`round_pipeline`
    batches after repeating). The same batches, bit for bit, in less time than a client's data takes through the
    dataset and `read_batches`' per-batch reads.
    """
    source = sources.get_single_element()
    examples = self._examples(source)
    count = tf.shape(examples['y'], out_type=tf.int64)[0] * self.local_epochs
    indices = tf.data.Dataset.range(tf.shape(examples['y'], out_type=tf.int64)[0])
    order = client_pipeline.shuffled(indices, source['seed'], source['seed2']).repeat(self.local_epochs).batch(
        count).get_single_element()
    offsets = tf.cast(tf.concat([tf.range(0, count, self.batch_size), [count]], 0), tf.int32)
    return tf.nest.map_structure(lambda leaf: tf.gather(leaf, order), examples), offsets

  def _examples(self, source):
    """The client's examples (`element_spec`'s structure, a leading example axis) read from the source's files."""
    spec = self.element_spec

    def load(leaf):
      tensor = tf.io.parse_tensor(tf.io.read_file(source['prefix'] + '.' + leaf), spec[leaf].dtype)
      return tf.ensure_shape(tensor, tf.TensorShape([None]).concatenate(spec[leaf].shape))

    return type(spec)(x=load('x'), y=load('y'))


@tf.function
def _source_datasets(prefixes, seeds, seeds2) -> list[tf.data.Dataset]:
  """One one-element dataset per client, (prefix, seed, seed2): built in one call (traced once per client count),
  where a `from_tensors` per client in Python costs 0.18 ms each (18 ms of a 100-client round's driver time)."""
  return [tf.data.Dataset.from_tensors(collections.OrderedDict(prefix=prefixes[i], seed=seeds[i], seed2=seeds2[i]))
          for i in range(prefixes.shape[0])]


class WorkerDatasets:
  """Client datasets the worker builds from files (docs/experiments.md); `inputs` is the run's `ClientInputs`."""

  def __init__(self, inputs, directory: Optional[str] = None):
    self._inputs = inputs
    train = inputs.train
    self._own_directory = directory is None
    self.directory = tempfile.mkdtemp(prefix='tff_gma_datasets_') if directory is None else directory
    os.chmod(self.directory, 0o700)  # Only this user reads the examples (the worker runs as this user).
    atexit.register(self.close)
    self._prefixes = {}
    spec = None
    for index, client_id in enumerate(train.client_ids):
      x, y = train.client_arrays(client_id)
      prefix = os.path.join(self.directory, str(index))
      for leaf, array in (('x', x), ('y', y)):
        with open(f'{prefix}.{leaf}', 'wb') as f:
          f.write(tf.io.serialize_tensor(np.ascontiguousarray(array)).numpy())
      self._prefixes[client_id] = prefix
      spec = spec or train.create_tf_dataset_for_client(client_id).element_spec
    self.client_sources = ClientSources(spec, inputs.local_epochs, inputs.batch_size)

  def sources(self, client_ids: Sequence[str], round_num: int) -> list[tf.data.Dataset]:
    """The round's source per client: its file prefix and the shuffle seeds `ClientInputs` shuffles it with."""
    seeds = np.array(self._inputs.seeds(client_ids, round_num), dtype=np.int64).reshape(-1, 2)
    return _source_datasets(tf.constant([self._prefixes[c] for c in client_ids], tf.string), seeds[:, 0], seeds[:, 1])

  def close(self) -> None:
    atexit.unregister(self.close)  # A study closes one per run: the exit hooks do not pile up.
    if self._own_directory:
      shutil.rmtree(self.directory, ignore_errors=True)
