"""The shared set-up of the method-reference suite: the tiny federation, the project's processes, the references.

A federation of `NUM_CLIENTS` clients with unequal example counts (`CLIENT_SIZES`), data in a fixed order (no
shuffling: batches of `BATCH_SIZE` in example order), one local epoch, client momentum 0.9; the model is the
project's `logistic` model on 2x2x1 inputs (4 features) and 3 classes, started from explicit weights. `run_project`
builds a method through the harness's one entry point (`training.engine.methods.build`, as the runner does) and
returns the model after each round; `run_reference` runs the NumPy reference of the same method
(`numpy_reference`, written from the papers) on the same data from the same weights.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tests.methods_reference import numpy_reference as ref
from tff_gma import models
from training import config as config_lib
from training.engine import methods

INPUT_SHAPE = (2, 2, 1)
NUM_CLASSES = 3
CLIENT_SIZES = (3, 5, 8, 6, 4)  # Unequal example counts: 1, 2, 3, 2 and 2 batches of at most 3.
NUM_CLIENTS = len(CLIENT_SIZES)
POPULATION = 7  # SCAFFOLD's N: 5 of 7 clients take part, so |S| / N = 5/7 is exercised.
BATCH_SIZE = 3
ROUNDS = 2
MODEL = ref.Logistic(features=int(np.prod(INPUT_SHAPE)), classes=NUM_CLASSES)

CLIENT_LR = 0.3
CLIENT_MOMENTUM = 0.9
SGD_SERVER_LR = 1.0
ADAPTIVE_SERVER_LR = 0.1
ADAPTIVE_EPSILON = 0.01  # Reddi's tau: large enough that v's start at tau^2 shows in the result.
PROXIMAL_STRENGTH = 0.5  # FedProx's mu: large enough that the proximal term's sign shows.
CORRUPT_FRACTION = 0.25  # trimmed_mean trims 1 per side of 5, krum keeps 4 of 5 (f = 1).
CC_CLIP_RADIUS = 1.0  # centered_clip's tau: between the clients' update norms here (0.4 to 2.2), so some clip.
BETA_1, BETA_2 = config_lib.ADAPTIVE_BETA_1, config_lib.ADAPTIVE_BETA_2


def federation(seed: int = 0) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
  """The clients' (x, y), label-skewed so that their updates disagree in sign, and the initial theta."""
  rng = np.random.default_rng(seed)
  clients = []
  for i, size in enumerate(CLIENT_SIZES):
    x = rng.normal(loc=0.6 * (i - 2), scale=1.0, size=(size,) + INPUT_SHAPE).astype(np.float32)
    y = ((np.arange(size) + i) % NUM_CLASSES if i % 2 else np.full(size, i % NUM_CLASSES)).astype(np.int32)
    clients.append((x, y))
  theta = rng.normal(scale=0.3, size=MODEL.size).astype(np.float32)
  return clients, theta


def model_fn():
  input_spec = collections.OrderedDict(
      x=tf.TensorSpec([None, *INPUT_SHAPE], tf.float32), y=tf.TensorSpec([None], tf.int32))
  return models.model_fn(models.keras_builder('logistic', INPUT_SHAPE, NUM_CLASSES), input_spec)


def algorithm_config(algorithm: str, adaptive_optimizer: str = 'reddi') -> config_lib.AlgorithmConfig:
  adaptive = algorithm in config_lib.ADAPTIVE_ALGORITHMS
  return config_lib.AlgorithmConfig(
      name=algorithm if algorithm in config_lib.FEDAVG_FAMILY else 'fedavg', client_lr=CLIENT_LR,
      server_lr=ADAPTIVE_SERVER_LR if adaptive else SGD_SERVER_LR, client_momentum=CLIENT_MOMENTUM,
      proximal_strength=PROXIMAL_STRENGTH, adaptive_epsilon=ADAPTIVE_EPSILON, adaptive_optimizer=adaptive_optimizer)


@dataclasses.dataclass(frozen=True)
class Case:
  """One algorithm x aggregator of the registry, with the aggregator's parameters."""
  algorithm: str
  aggregator: str
  num_passes: int = 3
  rfa_init: str = 'zero'
  adaptive_optimizer: str = 'reddi'  # FedAdam/FedYogi: Reddi's Algorithm 2, or TFF's bias-corrected optimizers.
  secure_bound: Optional[float] = None  # Set: the float means go through secure sums (`secure=True`) with it.

  @property
  def id(self) -> str:
    extra = f'-{self.rfa_init}{self.num_passes}' if self.aggregator == 'rfa' else ''
    if self.adaptive_optimizer != 'reddi':
      extra += f'-{self.adaptive_optimizer}'
    if self.secure_bound is not None:
      extra += '-secure'
    return f'{self.algorithm}-{self.aggregator}{extra}'

  def aggregator_params(self) -> config_lib.AggregatorParams:
    return config_lib.AggregatorParams(num_passes=self.num_passes, rfa_init=self.rfa_init,
                                       corrupt_fraction=CORRUPT_FRACTION, cc_clip_radius=CC_CLIP_RADIUS,
                                       secure=self.secure_bound is not None,
                                       secure_bound=self.secure_bound)

  def reference_aggregator(self, name: Optional[str] = None) -> ref.Aggregator:
    p = self.aggregator_params()
    return ref.Aggregator(ref.AggregatorConfig(
        name or self.aggregator, tau=p.tau, num_passes=p.num_passes, rfa_init=p.rfa_init, smoothing=p.smoothing,
        corrupt_fraction=p.corrupt_fraction, cc_clip_radius=p.cc_clip_radius, cc_iterations=p.cc_iterations))


def _datasets(clients) -> list[tf.data.Dataset]:
  return [tf.data.Dataset.from_tensor_slices(collections.OrderedDict(x=x, y=y)).batch(BATCH_SIZE)
          for x, y in clients]


@dataclasses.dataclass
class ProjectRun:
  """The project's models after each round (flat), and what its clients kept (SCAFFOLD's c_i, personal v_k)."""
  thetas: list[np.ndarray]
  client_state: list[dict[int, np.ndarray]]
  metrics: list


def run_project(case: Case, clients, theta0: np.ndarray, rounds: int = ROUNDS) -> ProjectRun:
  """Builds the case's method as the runner does (`methods.build`), sets theta0, runs `rounds` rounds."""
  method = methods.build(
      model_fn(), case.algorithm, case.aggregator,
      algorithm_config=algorithm_config(case.algorithm, case.adaptive_optimizer),
      aggregator_params=case.aggregator_params(), method_params=config_lib.MethodParams(),
      num_clients=POPULATION)
  process = method.process
  state = process.initialize()
  w, b = MODEL.split(theta0.astype(np.float64))
  state = process.set_model_weights(state, tff.learning.models.ModelWeights(
      trainable=[w.astype(np.float32), b.astype(np.float32)], non_trainable=[]))
  ids = [f'client_{i}' for i in range(len(clients))]
  datasets = _datasets(clients)
  out = ProjectRun([], [], [])
  for round_num in range(1, rounds + 1):
    state, metrics = method.run_round(state, ids, datasets, round_num)
    weights = process.get_model_weights(state)
    out.thetas.append(MODEL.flat(weights.trainable))
    out.metrics.append(metrics)
    kept = {}
    if method.client_state is not None:
      kept = {i: MODEL.flat(method.client_state.get(cid)) for i, cid in enumerate(ids)}
    out.client_state.append(kept)
  return out


def client_config(algorithm: str) -> ref.ClientConfig:
  return ref.ClientConfig(CLIENT_LR, CLIENT_MOMENTUM, PROXIMAL_STRENGTH if algorithm == 'fedprox' else 0.0)


def server(algorithm: str, adaptive_optimizer: str = 'reddi'):
  if algorithm in ('fedadam', 'fedyogi'):
    return ref.ServerAdaptive(algorithm[3:], ADAPTIVE_SERVER_LR, BETA_1, BETA_2, ADAPTIVE_EPSILON,
                              variant=adaptive_optimizer)
  return ref.ServerSGD(SGD_SERVER_LR)


def reference_method(case: Case):
  """The NumPy reference of `case` (its `round(theta, client_batches[, client_ids])`)."""
  client = client_config(case.algorithm)
  if case.aggregator == 'elastic':
    p = config_lib.MethodParams()
    return ref.Elastic(MODEL, client, server(case.algorithm, case.adaptive_optimizer), p.elastic_tau, p.elastic_mu,
                       p.sensitivity_fraction)
  if case.algorithm == 'fedgma':
    p = config_lib.MethodParams()
    return ref.FedGMA(MODEL, client, ref.ServerSGD(SGD_SERVER_LR), p.fedgma_step_size, p.fedgma_threshold)
  if case.algorithm == 'scaffold':
    return ref.Scaffold(MODEL, client, case.reference_aggregator(), ref.ServerSGD(SGD_SERVER_LR), POPULATION)
  if case.algorithm == 'personalized':
    return ref.PersonalizedRFA(MODEL, client, case.reference_aggregator(), ref.ServerSGD(SGD_SERVER_LR))
  # GMA with an adaptive server is the GMA paper's Algorithm 2 (the mask on the step) for both masks; gma_dropin
  # masks the optimizer's input instead (the documented drop-in placement).
  adaptive = case.algorithm in config_lib.ADAPTIVE_ALGORITHMS
  return ref.FedAvgFamily(MODEL, client, case.reference_aggregator(), server(case.algorithm, case.adaptive_optimizer),
                          mask_on_step=adaptive and case.aggregator in ('gma', 'gma_binary'))


def run_reference(case: Optional[Case], clients, theta0: np.ndarray, rounds: int = ROUNDS, method=None):
  """(thetas after each round, the reference method) from theta0, in float64: `case`'s reference, or `method`."""
  method = method if method is not None else reference_method(case)
  data = [ref.batches(x.astype(np.float64), y, BATCH_SIZE) for x, y in clients]
  theta, thetas = theta0.astype(np.float64), []
  for _ in range(rounds):
    if isinstance(method, (ref.Scaffold, ref.PersonalizedRFA)):
      theta = method.round(theta, data, list(range(len(data))))
    else:
      theta = method.round(theta, data)
    thetas.append(theta)
  return thetas, method
