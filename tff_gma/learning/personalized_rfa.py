"""Personalized RFA (RFA paper, Algorithm 4): shared parameters aggregated by RFA, personal parameters on device.

Model. As in the paper, a client predicts with the sum of the shared parameters w (the server model's trainable
weights) and its own personal parameters v_k of the same shapes (additive personalization, v_k = 0 initially):
the objective is sum_k alpha_k F_k(w + v_k). Non-trainable weights are shared only.

Round (residual learning, the paper's "train the shared and personalized parameters on each other's residuals"):

    client k:  phase 1 (personal): from w + v_k, local SGD on its batches with w fixed  -> v_k' = trained - w
               phase 2 (shared):   from w + v_k', local SGD on its batches with v_k' fixed -> w_k = trained - v_k'
               sends the model update w - w_k (TFF's `initial - trained`) with its number of examples as weight
    server:    w <- finalizer(w, aggregate(w - w_k))   -- `model_aggregator`, by default RFA (the geometric
               median, `tff_gma.aggregators.GeometricMedianFactory`); the mean gives personalized FedAvg.

Since d/dv F(w + v) = d/dw F(w + v), each phase is local SGD on the summed model; what differs is which part
keeps the result. Each phase makes one pass over the round's batches (the dataset as given, with its local epochs)
with a fresh client optimizer state; metrics are phase 2's. A client whose personal step is not finite keeps its
old v_k; a client whose update is not finite sends zero with weight 0 (TFF's convention).

Where the personal parameters live. TFF has no client state and a `LearningProcess` cannot output CLIENTS-placed
values, so v_k comes in with the client's data -- `OrderedDict(batches=<dataset of batches>, personal=<dataset of
at most one element: v_k as a tuple of arrays>)`, empty meaning v_k = 0 -- and goes out through
`PersonalizedProcess.next_with_personal`, which runs the same round as `next` and also returns every client's
v_k' at CLIENTS. In simulation `PersonalStore` keeps them by client id, saves them per round next to the server
checkpoint (`checkpoint`/`restore`, one .npz per round) and evaluates the personalized models on each client's
held-out examples (`hold_out`). The plain `next` drops the new v_k: it trains w only, with every v_k frozen.
"""

from __future__ import annotations

import collections
import glob
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma.aggregators import geometric_median
from tff_gma.data import client_data as client_data_lib
from tff_gma.learning import client_lib
from tff_gma.learning import client_store

ALGORITHM = 'personalized'  # The runner's --algorithm name (personalized RFA with --aggregator=rfa).
BATCHES = 'batches'
PERSONAL = 'personal'
PERSONAL_TEST_FRACTION = 0.2  # Share of each client's examples held out to evaluate its personalized model.
_HOLD_OUT_STREAM = 0x5046_5241


class PersonalizedOutput(NamedTuple):
  """Result of `PersonalizedProcess.next_with_personal`."""
  state: Any  # The `LearningAlgorithmState`, as from `next`.
  metrics: Any  # As from `next`.
  personal: Any  # Per client (CLIENTS-placed): its new v_k, a tuple of arrays.


# ----------------------------------------------------------------------------------------------------------------
# Plain TF (client side).


def build_personalized_client_update(model_fn: Callable[[], tff.learning.models.VariableModel],
                                     optimizer: tff.learning.optimizers.Optimizer):
  """A `tf.function` (initial_weights, batches, personal_data) -> (ClientResult, v_k', unfinalized metrics)."""
  model = model_fn()

  @tf.function
  def client_update(initial_weights, batches, personal_data):
    model_weights = tff.learning.models.ModelWeights.from_model(model)
    trainable = tf.nest.flatten(model_weights.trainable)
    shared = tuple(tf.nest.flatten(initial_weights.trainable))
    zeros = client_lib.zeros_like_trainable(model_weights)
    personal = personal_data.reduce(zeros, lambda _, p: tuple(tf.nest.flatten(p)))
    client_lib.assign_weights(model_weights, initial_weights)
    for variable, w, v in zip(trainable, shared, personal):
      variable.assign(w + v)

    def local_pass():
      def reduce_fn(state, batch):
        optimizer_state, num_examples = state
        optimizer_state, batch_examples = client_lib.optimizer_step(
            optimizer, optimizer_state, model, model_weights, batch)
        return optimizer_state, num_examples + batch_examples

      initial = (client_lib.initial_optimizer_state(optimizer, model_weights), tf.constant(0, tf.int64))
      return batches.reduce(initial, reduce_fn)[1]

    # Phase 1: the personal parameters on the residual of the shared ones (w fixed).
    local_pass()
    new_personal = tuple(t - w for t, w in zip(trainable, shared))
    new_personal, personal_non_finite = client_lib.zero_all_if_any_non_finite(new_personal)
    new_personal = tuple(tf.where(personal_non_finite > 0, v, n) for v, n in zip(personal, new_personal))
    for variable, w, v in zip(trainable, shared, new_personal):
      variable.assign(w + v)
    model.reset_metrics()
    # Phase 2: the shared parameters on the residual of the new personal ones (v_k' fixed).
    start = tuple(tf.identity(t) for t in trainable)
    num_examples = local_pass()
    update, weight, _, non_finite = client_lib.finish_client_update(start, model_weights, num_examples)
    client_lib.reset_metrics_if(model, non_finite)
    return (tff.learning.templates.ClientResult(update=list(update), update_weight=weight), new_personal,
            model.report_local_unfinalized_metrics())

  return client_update


# ----------------------------------------------------------------------------------------------------------------
# Federated pieces.


class PersonalizedProcess(tff.learning.templates.LearningProcess):
  """A `LearningProcess` for personalized RFA, plus `next_with_personal` (module docstring).

  Attributes:
    next_with_personal: `(state, client_data) -> PersonalizedOutput(state, metrics, personal)`, the same round as
      `next` that also returns each client's new personal parameters (CLIENTS-placed; in simulation a list in
      client order).
    personal_type: the TFF type of v_k (a tuple with one tensor per trainable variable).
  """

  def __init__(self, composed: tff.learning.templates.LearningProcess, next_with_personal: tff.Computation,
               personal_type):
    super().__init__(composed.initialize, composed.next, composed.get_model_weights, composed.set_model_weights,
                     get_hparams_fn=composed.get_hparams, set_hparams_fn=composed.set_hparams)
    self.next_with_personal = next_with_personal
    self.personal_type = personal_type


def build_personalized_rfa(
    model_fn: Callable[[], tff.learning.models.VariableModel],
    client_optimizer: tff.learning.optimizers.Optimizer,
    server_optimizer: Optional[tff.learning.optimizers.Optimizer] = None,
    model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
    metrics_aggregator=None,
) -> PersonalizedProcess:
  """Personalized RFA (RFA paper, Algorithm 4) as a `PersonalizedProcess`.

  Args:
    model_fn: no-arg callable returning a `tff.learning.models.VariableModel`.
    client_optimizer: the local optimizer of both phases (e.g. `tff.learning.optimizers.build_sgdm(0.05)`).
    server_optimizer: applied to the aggregated update; default SGD with learning rate 1 (w <- aggregate).
    model_aggregator: weighted factory for the shared updates; default RFA,
      `tff_gma.aggregators.GeometricMedianFactory()` (3 passes).
    metrics_aggregator: as in TFF's builders (default `tff.learning.metrics.sum_then_finalize`).

  Raises:
    ValueError: for an invalid argument (the message names it).
  """
  client_optimizer = client_lib.check_optimizer(client_optimizer, 'client_optimizer')
  server_optimizer = client_lib.check_optimizer(
      server_optimizer if server_optimizer is not None else tff.learning.optimizers.build_sgdm(1.0),
      'server_optimizer')
  if model_aggregator is None:
    model_aggregator = geometric_median.GeometricMedianFactory()
  elif not isinstance(model_aggregator, tff.aggregators.WeightedAggregationFactory):
    raise ValueError(f'model_aggregator must be a tff.aggregators.WeightedAggregationFactory, got '
                     f'{model_aggregator!r}')
  types = client_lib.model_types(model_fn, metrics_aggregator)
  personal_type = tff.StructWithPythonType(list(tff.structure.flatten(types.trainable_type)), tuple)
  data_type = tff.StructWithPythonType(
      [(BATCHES, tff.SequenceType(types.batch_type)), (PERSONAL, tff.SequenceType(personal_type))],
      collections.OrderedDict)

  @tff.tensorflow.computation(types.weights_type, data_type)
  def client_update_computation(initial_weights, data):
    client_update = build_personalized_client_update(model_fn, client_optimizer)
    return client_update(initial_weights, data[BATCHES], data[PERSONAL])

  @tff.federated_computation()
  def init_fn():
    return tff.federated_value((), tff.SERVER)

  @tff.federated_computation(init_fn.type_signature.result, tff.FederatedType(types.weights_type, tff.CLIENTS),
                             tff.FederatedType(data_type, tff.CLIENTS))
  def client_round(state, weights, client_data):
    client_result, new_personal, local_metrics = tff.federated_map(client_update_computation, (weights, client_data))
    measurements = tff.federated_zip(collections.OrderedDict(train=types.metrics_aggregation_fn(local_metrics)))
    return state, client_result, measurements, new_personal

  composed, next_with_personal = client_lib.compose_keeping_client_values(
      types, init_fn, client_round, model_aggregator, server_optimizer, PersonalizedOutput)
  return PersonalizedProcess(composed, next_with_personal, personal_type)


# ----------------------------------------------------------------------------------------------------------------
# Simulation: the clients' personal parameters.


def hold_out(train: client_data_lib.ArrayClientData, fraction: float, seed: int
             ) -> tuple[client_data_lib.ArrayClientData, dict[str, tuple[np.ndarray, np.ndarray]]]:
  """Splits each client's examples: (training clients, {client id: held-out (x, y)}).

  floor(fraction * n) examples per client, drawn from the seed, are held out (none for a client of one example);
  every client keeps at least one training example.
  """
  fraction = client_lib.check_fraction(fraction, 'fraction', high_open=True)
  rng = np.random.default_rng(np.random.SeedSequence([seed, _HOLD_OUT_STREAM]))
  kept, held = collections.OrderedDict(), {}
  for cid in train.client_ids:
    x, y = train.client_arrays(cid)
    count = min(int(np.floor(fraction * len(y))), len(y) - 1)
    order = rng.permutation(len(y))
    test_idx, train_idx = np.sort(order[:count]), np.sort(order[count:])
    kept[cid] = (x[train_idx], y[train_idx])
    if count:
      held[cid] = (x[test_idx], y[test_idx])
  return client_data_lib.from_client_arrays(kept), held


class PersonalStore(client_store.ClientArrayStore):
  """The clients' personal parameters v_k in simulation, by client id (zeros for a client not seen yet).

  Usage::

      store = PersonalStore.for_process(process)
      for round_num in ...:
        state, metrics = store.run_round(process, state, client_ids, [datasets of batches])
        store.checkpoint(output_dir, round_num)     # before the server state's checkpoint of the round
      store.restore(output_dir, round_num)          # on resume: the personal parameters after that round
  """

  what = 'personal parameters'

  def __init__(self, shapes: Sequence[Sequence[int]], dtypes: Sequence[Any],
               held_out: Optional[Mapping[str, tuple[np.ndarray, np.ndarray]]] = None, keep_total: int = 3):
    super().__init__(shapes, dtypes)
    if isinstance(keep_total, bool) or not isinstance(keep_total, int) or keep_total < 1:
      raise ValueError(f'keep_total must be a positive integer, got {keep_total!r}')
    self._held_out = dict(held_out or {})
    self._keep_total = keep_total

  @classmethod
  def for_process(cls, process: PersonalizedProcess, **kwargs) -> 'PersonalStore':
    return cls(*cls.shapes_and_dtypes(process.personal_type), **kwargs)

  def client_data(self, client_id: str, batches: tf.data.Dataset) -> collections.OrderedDict:
    """The process's client data: the batches and a one-element dataset holding the client's v_k."""
    return collections.OrderedDict([(BATCHES, batches), (PERSONAL, self.as_dataset(client_id))])

  def run_round(self, process: PersonalizedProcess, state, client_ids: Sequence[str],
                datasets: Sequence[tf.data.Dataset]):
    """One round on `client_ids` with their batch datasets; stores their new v_k; returns (state, metrics)."""
    if len(client_ids) != len(datasets):
      raise ValueError(f'client_ids and datasets must have the same length, got {len(client_ids)} and '
                       f'{len(datasets)}')
    output = process.next_with_personal(
        state, [self.client_data(cid, ds) for cid, ds in zip(client_ids, datasets)])
    for client_id, personal in zip(client_ids, output.personal):
      self.set(client_id, personal)
    return output.state, output.metrics

  # Persistence.

  def load(self, path: str) -> None:
    """Replaces the stored v_k by those of a `save`d file."""
    self.load_from(path)

  @staticmethod
  def _round_path(directory: str, round_num: int) -> str:
    return os.path.join(directory, 'personal', f'round_{round_num}.npz')

  def checkpoint(self, output_dir: str, round_num: int) -> None:
    """Saves the store as of `round_num` under `output_dir/personal/`, keeping the latest `keep_total` rounds.

    Call it before saving the server state of the round: a server checkpoint then always has its personal one.
    """
    path = self._round_path(output_dir, round_num)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    self.save(path)
    saved = sorted((int(m.group(1)), p) for p in glob.glob(os.path.join(os.path.dirname(path), 'round_*.npz'))
                   if (m := re.fullmatch(r'round_(\d+)\.npz', os.path.basename(p))))
    for _, old in saved[:-self._keep_total]:
      os.remove(old)

  def restore(self, output_dir: str, round_num: int) -> None:
    """Loads the store as of `round_num` (round 0: empty, every v_k = 0). FileNotFoundError if it was not saved."""
    if round_num == 0:
      self.clear()
      return
    path = self._round_path(output_dir, round_num)
    if not os.path.exists(path):
      raise FileNotFoundError(f'no personal parameters saved for round {round_num} ({path}); the output directory '
                              f'is incomplete')
    self.load(path)

  # Evaluation.

  def personalized_weights(self, model_weights: tff.learning.models.ModelWeights,
                           client_id: str) -> tff.learning.models.ModelWeights:
    """w + v_k (non-trainable weights shared)."""
    trainable = [np.asarray(w) + v for w, v in zip(model_weights.trainable, self.get(client_id))]
    return tff.learning.models.ModelWeights(trainable=trainable, non_trainable=list(model_weights.non_trainable))

  def evaluate(self, evaluator, model_weights: tff.learning.models.ModelWeights) -> dict[str, float]:
    """On every client's held-out examples: `personalized/*` (w + v_k) and `personalized/shared_*` (w alone).

    Example-weighted over clients; `evaluator` is a `tff_gma.simulation.CentralEvaluator` (its
    `evaluate_arrays`). Empty without held-out examples.
    """
    if not self._held_out:
      return {}
    totals = collections.defaultdict(float)
    count = 0
    for cid, (x, y) in sorted(self._held_out.items()):
      personalized = evaluator.evaluate_arrays(self.personalized_weights(model_weights, cid), x, y)
      shared = evaluator.evaluate_arrays(model_weights, x, y)
      for name, value in personalized.items():
        totals[f'personalized/{name}'] += value * len(y)
      for name, value in shared.items():
        totals[f'personalized/shared_{name}'] += value * len(y)
      count += len(y)
    return {k: v / count for k, v in totals.items()}
