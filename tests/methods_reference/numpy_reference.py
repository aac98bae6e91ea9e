"""NumPy references of every method the registry offers, written from the papers, not from the project's code.

Each rule below cites where it comes from: the paper's equation or algorithm line, or, where the project documents a
deliberate difference from the paper (docs/methods.md, "Where we differ from the papers"), that documented rule.
The tests (`reference_test.py`) run the project's learning processes and these references from the same initial
model on the same data, and compare the models after each round.

The model is multinomial logistic regression, logits = x W + b (the project's `logistic` model: Keras' Flatten and
Dense), with the mean softmax cross-entropy over a batch. Parameters travel as one flat float64 vector theta =
[W.ravel(), b] (`SHAPES` gives the tensors, in the model's order), so the aggregators see the whole flattened
update, as RFA's norm and Krum's distances require; Elastic's per-layer maximum uses `SHAPES`.

Updates use TFF's sign, Delta_i = theta - theta_i (the server model minus the client's trained model), which every
server step applies as a pseudo-gradient: theta <- theta - lr * aggregate. FedAvg's `theta + mean(theta_i - theta)`
is the same step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np

# ---------------------------------------------------------------------------------------------------------------
# The model: logistic regression on flattened inputs.


@dataclasses.dataclass(frozen=True)
class Logistic:
  """Softmax regression with `features` inputs and `classes` outputs; theta = [W.ravel(), b]."""
  features: int
  classes: int

  @property
  def shapes(self) -> tuple[tuple[int, ...], ...]:
    return ((self.features, self.classes), (self.classes,))

  @property
  def size(self) -> int:
    return self.features * self.classes + self.classes

  def split(self, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    cut = self.features * self.classes
    return theta[:cut].reshape(self.features, self.classes), theta[cut:]

  def flat(self, tensors: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(t, np.float64).ravel() for t in tensors])

  def segments(self) -> list[slice]:
    """The slice of theta holding each tensor (Elastic's "layer")."""
    out, start = [], 0
    for shape in self.shapes:
      size = int(np.prod(shape))
      out.append(slice(start, start + size))
      start += size
    return out

  def logits(self, theta: np.ndarray, x: np.ndarray) -> np.ndarray:
    w, b = self.split(theta)
    return x.reshape(len(x), -1) @ w + b

  def loss_gradient(self, theta: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Gradient of the batch mean of -log softmax(logits)[y] (McMahan et al.'s F_k on one minibatch)."""
    z = self.logits(theta, x)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    dz = p / len(y)
    flat_x = x.reshape(len(x), -1)
    return self.flat([flat_x.T @ dz, dz.sum(axis=0)])

  def output_norm_gradient(self, theta: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Elastic Algorithm 1's g = grad ||F(theta; x)||_2^2, the batch mean of the per-example squared logit norms."""
    z = self.logits(theta, x)
    dz = 2.0 * z / len(x)
    flat_x = x.reshape(len(x), -1)
    return self.flat([flat_x.T @ dz, dz.sum(axis=0)])


Batches = list[tuple[np.ndarray, np.ndarray]]


def batches(x: np.ndarray, y: np.ndarray, batch_size: int) -> Batches:
  """The client's examples in their order (no shuffling), in consecutive batches; the last may be short."""
  return [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, len(x), batch_size)]


def num_examples(data: Batches) -> int:
  return sum(len(y) for _, y in data)


# ---------------------------------------------------------------------------------------------------------------
# Client optimisation.


def sgdm_pass(theta: np.ndarray, data: Batches, lr: float, momentum: float,
              gradient: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray],
              correction: Optional[np.ndarray] = None) -> tuple[np.ndarray, list[np.ndarray]]:
  """One local epoch of SGD with heavy-ball momentum, one step per batch, the momentum starting at 0.

  The step (TFF's `build_sgdm`, the client optimizer of every method here): m <- momentum * m + d; theta <- theta -
  lr * m, with d = gradient(theta, batch) (+ `correction`, SCAFFOLD's c - c_i). Returns the trained theta and the
  uncorrected gradients of the steps, in order.
  """
  theta = theta.copy()
  velocity = np.zeros_like(theta)
  seen = []
  for x, y in data:
    g = gradient(theta, x, y)
    seen.append(g)
    d = g if correction is None else g + correction
    velocity = momentum * velocity + d
    theta = theta - lr * velocity
  return theta, seen


@dataclasses.dataclass(frozen=True)
class ClientConfig:
  lr: float
  momentum: float
  proximal_strength: float = 0.0  # FedProx's mu.


def local_training(model: Logistic, theta: np.ndarray, data: Batches, config: ClientConfig) -> np.ndarray:
  """FedAvg's ClientUpdate (McMahan et al., Algorithm 1) with momentum; with mu > 0, FedProx's (Li et al.): the
  client minimises F_k(w) + mu/2 ||w - w_t||^2, whose gradient adds mu (w - w_t) to the loss gradient."""
  start = theta.copy()
  mu = config.proximal_strength

  def gradient(w, x, y):
    return model.loss_gradient(w, x, y) + mu * (w - start)

  trained, _ = sgdm_pass(theta, data, config.lr, config.momentum, gradient)
  return trained


# ---------------------------------------------------------------------------------------------------------------
# Aggregators: (client updates [n, d], client weights [n]) -> aggregate [d]. Stateful ones keep their state.


def weighted_mean(points: np.ndarray, weights: np.ndarray) -> np.ndarray:
  """FedAvg's aggregate: sum_i a_i w_i / sum_i a_i (McMahan et al.: a_i = n_i, the client's example count)."""
  weights = np.asarray(weights, np.float64)
  return (weights[:, None] * points).sum(axis=0) / weights.sum()


def gma_mask(points: np.ndarray, tau: float, mask: str) -> np.ndarray:
  """GMA paper eq. (3): A = |(1/N) sum_n sign(Delta_n)|, m = 1 if A >= tau else A (soft; binary: 0)."""
  agreement = np.abs(np.sign(points).sum(axis=0)) / len(points)
  below = agreement if mask == 'soft' else np.zeros_like(agreement)
  return np.where(agreement >= tau, 1.0, below)


def geometric_median(points: np.ndarray, weights: np.ndarray, num_passes: int, init: str,
                     smoothing: float) -> np.ndarray:
  """RFA paper Algorithm 2, smoothed Weiszfeld with a budget of `num_passes` weighted averages.

  init='mean' (the paper): pass 1 is the weighted mean, each further pass v <- sum_i b_i w_i / sum_i b_i with
  b_i = a_i / max(nu, ||v - w_i||). init='zero' (the project's documented default): v starts at the zero update and
  every pass reweights (pass 1 is one-step RFA, Algorithm 3).
  """
  weights = np.asarray(weights, np.float64)
  if init == 'mean':
    estimate, remaining = weighted_mean(points, weights), num_passes - 1
  elif init == 'zero':
    estimate, remaining = np.zeros(points.shape[1]), num_passes
  else:
    raise ValueError(f'init must be mean or zero, got {init!r}')
  for _ in range(remaining):
    distances = np.linalg.norm(points - estimate, axis=1)
    estimate = weighted_mean(points, weights / np.maximum(smoothing, distances))
  return estimate


def one_step_rfa(points: np.ndarray, weights: np.ndarray, smoothing: float) -> np.ndarray:
  """RFA paper Algorithm 3: one reweighted average from v = 0, b_i = a_i / max(nu, ||w_i||)."""
  weights = np.asarray(weights, np.float64)
  return weighted_mean(points, weights / np.maximum(smoothing, np.linalg.norm(points, axis=1)))


def coordinate_median(points: np.ndarray) -> np.ndarray:
  """Yin et al. (2018): per coordinate, the median of the client values (unweighted)."""
  return np.median(points, axis=0)


def centered_clipping(points: np.ndarray, weights: np.ndarray, tau: float, iterations: int) -> np.ndarray:
  """Karimireddy et al. (2021), centered clipping from v = 0 (documented): L times,
  v <- v + sum_i a_i (w_i - v) min(1, tau / ||w_i - v||) / sum_i a_i."""
  weights = np.asarray(weights, np.float64)
  v = np.zeros(points.shape[1])
  for _ in range(iterations):
    differences = points - v
    norms = np.linalg.norm(differences, axis=1)
    scales = np.minimum(1.0, tau / np.maximum(norms, 1e-300))
    v = v + weighted_mean(differences * scales[:, None], weights)
  return v


def _round_half_up(x: float) -> int:
  return int(math.floor(x + 0.5))


def trimmed_mean(points: np.ndarray, trim_fraction: float) -> np.ndarray:
  """Yin et al. (2018): per coordinate, drop the k largest and k smallest values and average the rest (unweighted);
  k = round(beta n), at most (n - 1) // 2 (the documented rounding)."""
  n = len(points)
  k = min(_round_half_up(trim_fraction * n), (n - 1) // 2)
  ordered = np.sort(points, axis=0)
  return ordered[k:n - k].mean(axis=0)


def multi_krum(points: np.ndarray, weights: np.ndarray, byzantine_fraction: float) -> np.ndarray:
  """Blanchard et al. (2017), multi-Krum: f = round(beta n); score_i = sum of the squared distances from w_i to its
  n - f - 2 nearest other points; the m = n - f lowest scores are averaged (weighted by a_i, documented)."""
  n = len(points)
  f = _round_half_up(byzantine_fraction * n)
  neighbours = min(max(n - f - 2, 1), max(n - 1, 1))
  scores = []
  for i in range(n):
    others = [np.sum((points[i] - points[j]) ** 2) for j in range(n) if j != i]
    scores.append(sum(sorted(others)[:neighbours]))
  selected = np.argsort(np.asarray(scores), kind='stable')[:max(n - f, 1)]
  return weighted_mean(points[selected], np.asarray(weights)[selected])


@dataclasses.dataclass
class AdaptiveNormBound:
  """Andrew, Thakkar et al. (2021), "Differentially Private Learning with Adaptive Clipping", without noise, the
  geometric update: C <- C exp(-eta (b - gamma)), b the fraction of clients whose norm is at most C.

  The bound applied in a round is `multiplier * C + increment` with the estimate C from before the round (TFF's
  `PrivateQuantileEstimationProcess.no_noise` with its affine report).
  """
  estimate: float
  target_quantile: float
  learning_rate: float
  multiplier: float = 1.0
  increment: float = 0.0
  # (bound applied, clients over it) of each round so far: what TFF measures as clipping_norm/zeroing_norm and
  # clipped_count/zeroed_count.
  history: list[tuple[float, int]] = dataclasses.field(default_factory=list)

  @property
  def bound(self) -> float:
    return self.multiplier * self.estimate + self.increment

  def update(self, norms: np.ndarray) -> None:
    self.history.append((self.bound, int(np.sum(norms > self.bound))))
    below = float(np.mean(norms <= self.estimate))
    self.estimate *= math.exp(-self.learning_rate * (below - self.target_quantile))


def clipped_mean(points: np.ndarray, weights: np.ndarray, bound: AdaptiveNormBound) -> np.ndarray:
  """Each update scaled to L2 norm at most the bound, then the weighted mean; then the bound adapts (median)."""
  norms = np.linalg.norm(points, axis=1)
  scale = np.minimum(1.0, bound.bound / np.maximum(norms, 1e-300))
  result = weighted_mean(points * scale[:, None], weights)
  bound.update(norms)
  return result


def zeroed_mean(points: np.ndarray, weights: np.ndarray, bound: AdaptiveNormBound) -> np.ndarray:
  """Updates whose max-norm exceeds the bound are replaced by zeros (their weight kept), then the weighted mean;
  then the bound adapts (TFF's `zeroing_factory`, whose norm defaults to the infinity norm)."""
  norms = np.max(np.abs(points), axis=1)
  kept = np.where((norms > bound.bound)[:, None], 0.0, points)
  result = weighted_mean(kept, weights)
  bound.update(norms)
  return result


@dataclasses.dataclass(frozen=True)
class AggregatorConfig:
  """Which aggregator and its parameters (the registry's names)."""
  name: str
  tau: float = 0.4
  num_passes: int = 3
  rfa_init: str = 'zero'
  smoothing: float = 1e-6
  corrupt_fraction: float = 0.0
  cc_clip_radius: float = 10.0
  cc_iterations: int = 3


class Aggregator:
  """A registry aggregator's reference. `mean_and_mask` gives (aggregate before any mask, mask); the mask is all
  ones except for GMA."""

  def __init__(self, config: AggregatorConfig):
    self.config = config
    if config.name == 'clip_mean':
      self.bound = AdaptiveNormBound(1.0, 0.5, 0.2)
    elif config.name == 'zeroing_mean':
      self.bound = AdaptiveNormBound(10.0, 0.98, math.log(10.0), multiplier=2.0, increment=1.0)

  def mean_and_mask(self, points: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    c = self.config
    ones = np.ones(points.shape[1])
    if c.name == 'mean':
      return weighted_mean(points, weights), ones
    if c.name in ('gma', 'gma_dropin'):
      return weighted_mean(points, weights), gma_mask(points, c.tau, 'soft')
    if c.name == 'gma_binary':
      return weighted_mean(points, weights), gma_mask(points, c.tau, 'binary')
    if c.name == 'rfa':
      return geometric_median(points, weights, c.num_passes, c.rfa_init, c.smoothing), ones
    if c.name == 'rfa_one_step':
      return one_step_rfa(points, weights, c.smoothing), ones
    if c.name == 'median':
      return coordinate_median(points), ones
    if c.name == 'trimmed_mean':
      return trimmed_mean(points, c.corrupt_fraction), ones
    if c.name == 'krum':
      return multi_krum(points, weights, c.corrupt_fraction), ones
    if c.name == 'centered_clip':
      return centered_clipping(points, weights, c.cc_clip_radius, c.cc_iterations), ones
    if c.name == 'clip_mean':
      return clipped_mean(points, weights, self.bound), ones
    if c.name == 'zeroing_mean':
      return zeroed_mean(points, weights, self.bound), ones
    raise ValueError(f'no reference for aggregator {c.name!r}')

  def __call__(self, points: np.ndarray, weights: np.ndarray) -> np.ndarray:
    mean, mask = self.mean_and_mask(points, weights)
    return mask * mean


# ---------------------------------------------------------------------------------------------------------------
# Server optimizers: theta <- step(theta, u) for the aggregated pseudo-gradient u (TFF's sign: u = -Delta_Reddi).


class ServerSGD:
  """theta <- theta - lr * u (FedAvg's server; lr = 1 is the plain average of the client models)."""

  def __init__(self, lr: float):
    self.lr = lr

  def step(self, theta: np.ndarray, u: np.ndarray, mask: Optional[np.ndarray] = None) -> np.ndarray:
    return theta - self.lr * (u if mask is None else mask * u)


class ServerAdaptive:
  """Reddi et al. (2021), Algorithm 2 (FedAdam, FedYogi), with Delta = -u:

      m <- b1 m + (1 - b1) Delta
      v <- b2 v + (1 - b2) Delta^2                                   (Adam)
      v <- v - (1 - b2) Delta^2 sign(v - Delta^2)                    (Yogi)
      x <- x + eta m / (sqrt(v) + tau)

  m starts at 0 and v at tau^2, no bias correction (`variant='reddi'`, the project's default). `variant='tff'` is
  the documented alternative, TFF's `build_adam`/`build_yogi` (Kingma and Ba's bias correction): eta is multiplied
  by sqrt(1 - b2^t) / (1 - b1^t) in round t, and v starts at 0 (Adam) or 1e-6 (Yogi's default preconditioner).
  `mask` (GMA paper, Algorithm 2) scales the step only: the moments see the unmasked Delta.
  """

  def __init__(self, kind: str, lr: float, beta_1: float, beta_2: float, tau: float, variant: str = 'reddi'):
    if kind not in ('adam', 'yogi') or variant not in ('reddi', 'tff'):
      raise ValueError(f'{kind} {variant}')
    self.kind, self.lr, self.beta_1, self.beta_2, self.tau = kind, lr, beta_1, beta_2, tau
    self.variant = variant
    self.t = 0
    self.m: Optional[np.ndarray] = None
    self.v: Optional[np.ndarray] = None

  def step(self, theta: np.ndarray, u: np.ndarray, mask: Optional[np.ndarray] = None) -> np.ndarray:
    delta = -u
    if self.m is None:
      start = self.tau ** 2 if self.variant == 'reddi' else (0.0 if self.kind == 'adam' else 1e-6)
      self.m, self.v = np.zeros_like(theta), np.full_like(theta, start)
    self.t += 1
    self.m = self.beta_1 * self.m + (1 - self.beta_1) * delta
    if self.kind == 'adam':
      self.v = self.beta_2 * self.v + (1 - self.beta_2) * delta ** 2
    else:
      self.v = self.v - (1 - self.beta_2) * delta ** 2 * np.sign(self.v - delta ** 2)
    lr = self.lr
    if self.variant == 'tff':
      lr *= math.sqrt(1 - self.beta_2 ** self.t) / (1 - self.beta_1 ** self.t)
    step = lr * self.m / (np.sqrt(self.v) + self.tau)
    return theta + (step if mask is None else mask * step)


# ---------------------------------------------------------------------------------------------------------------
# Methods: one round each, `round(theta, client_data) -> theta`; state (server moments, control variates, personal
# parameters, adaptive bounds) is kept on the object between rounds.


class FedAvgFamily:
  """FedAvg / FedProx (server SGD) and FedAdam / FedYogi (Reddi's server) with a registry aggregator.

  `mask_on_step` (GMA's Algorithm 2 with an adaptive server, the registry's `gma`): the optimizer gets the unmasked
  weighted mean and the mask scales its step. Otherwise (`gma_dropin`, and every aggregator with an SGD server)
  the optimizer gets the aggregate, masked for GMA.
  """

  def __init__(self, model: Logistic, client: ClientConfig, aggregator: Aggregator, server, mask_on_step: bool):
    self.model, self.client, self.aggregator, self.server = model, client, aggregator, server
    self.mask_on_step = mask_on_step
    self.rounds: list[tuple[np.ndarray, np.ndarray]] = []  # Each round's client updates and weights.

  def round(self, theta: np.ndarray, client_data: Sequence[Batches]) -> np.ndarray:
    points = np.stack([theta - local_training(self.model, theta, data, self.client) for data in client_data])
    weights = np.array([num_examples(data) for data in client_data], np.float64)
    self.rounds.append((points, weights))
    mean, mask = self.aggregator.mean_and_mask(points, weights)
    if self.mask_on_step:
      return self.server.step(theta, mean, mask)
    return self.server.step(theta, mask * mean)


class Elastic:
  """Elastic Aggregation paper, Algorithm 1, with the client's FedAvg momentum SGD and any server optimizer.

  Client k: B_k = its first k batches, k = min(ceil(fraction * n), n - 1) (at least one batch left; the documented
  reading of "sample a subset", fixed here because the data order is); Omega_k <- mu Omega_k + (1 - mu) |g| over
  B_k at theta; local training on D_k (the other batches); weight |D_k|. Server: Omega = sum_k w_k Omega_k, Delta =
  sum_k w_k Delta_k; per layer (tensor) zeta = 1 + tau - Omega / max(Omega) (zeta = 1 where max(Omega) = 0,
  documented); theta <- server step of zeta * Delta. `per_tensor=False` takes the maximum over the whole model
  instead (used only to show that the two readings give different models here).
  """

  def __init__(self, model: Logistic, client: ClientConfig, server, tau: float, mu: float, fraction: float,
               per_tensor: bool = True):
    self.model, self.client, self.server = model, client, server
    self.tau, self.mu, self.fraction, self.per_tensor = tau, mu, fraction, per_tensor

  def round(self, theta: np.ndarray, client_data: Sequence[Batches]) -> np.ndarray:
    updates, sensitivities, weights = [], [], []
    for data in client_data:
      n = len(data)
      k = max(min(math.ceil(self.fraction * n), n - 1), 0)
      omega = np.zeros_like(theta)
      for x, _ in data[:k]:
        omega = self.mu * omega + (1 - self.mu) * np.abs(self.model.output_norm_gradient(theta, x))
      trained = local_training(self.model, theta, data[k:], self.client)
      updates.append(theta - trained)
      sensitivities.append(omega)
      weights.append(num_examples(data[k:]))
    weights = np.asarray(weights, np.float64)
    omega, delta = weighted_mean(np.stack(sensitivities), weights), weighted_mean(np.stack(updates), weights)
    zeta = np.ones_like(theta)
    for part in self.model.segments() if self.per_tensor else [slice(None)]:
      top = omega[part].max()
      if top > 0:
        zeta[part] = 1 + self.tau - omega[part] / top
    return self.server.step(theta, zeta * delta)


class FedGMA:
  """Gradient-Masked Federated Optimization (workshop paper, Algorithm 1), as documented.

  Client k: grad^k = the gradient of its loss at the round's model w, over all its examples (the text's "gradient
  of their loss with respect to the initial parameters"), then FedAvg's local training -> w^k; weight m_k = its
  example count. Server: w' = sum_k m_k w^k / sum m_k (line 8); grad = AND-mask * sum_k m_k grad^k / sum m_k
  (line 7); w_t = w' - eta_s grad (line 9), through the server SGD at server_lr. AND-mask (Sec. 4's reading): a
  coordinate is kept iff at least a fraction p of the clients agree on its sign (a zero gradient counts half for
  each sign). `literal_threshold=True` is Sec. 3's formula instead, I{p k <= |sum_k sign(g^k)|} (used only to show
  that the two readings give different models here).
  """

  def __init__(self, model: Logistic, client: ClientConfig, server: ServerSGD, step_size: float, threshold: float,
               literal_threshold: bool = False):
    self.model, self.client, self.server = model, client, server
    self.step_size, self.threshold, self.literal_threshold = step_size, threshold, literal_threshold
    self.masks: list[np.ndarray] = []  # Each round's AND-mask.

  def round(self, theta: np.ndarray, client_data: Sequence[Batches]) -> np.ndarray:
    updates, gradients, weights = [], [], []
    for data in client_data:
      x = np.concatenate([b[0] for b in data])
      y = np.concatenate([b[1] for b in data])
      gradients.append(self.model.loss_gradient(theta, x, y))
      updates.append(theta - local_training(self.model, theta, data, self.client))
      weights.append(len(y))
    gradients, weights = np.stack(gradients), np.asarray(weights, np.float64)
    k = len(gradients)
    positive = (gradients > 0).sum(axis=0) + 0.5 * (gradients == 0).sum(axis=0)
    negative = (gradients < 0).sum(axis=0) + 0.5 * (gradients == 0).sum(axis=0)
    if self.literal_threshold:
      mask = (np.abs(np.sign(gradients).sum(axis=0)) >= self.threshold * k - 1e-9).astype(np.float64)
    else:
      mask = (np.maximum(positive, negative) >= self.threshold * k - 1e-9).astype(np.float64)
    self.masks.append(mask)
    u = weighted_mean(np.stack(updates), weights) + self.step_size * mask * weighted_mean(gradients, weights)
    return self.server.step(theta, u)


class Scaffold:
  """SCAFFOLD (Karimireddy et al., 2020, Algorithm 1, option II) with the client's momentum, as documented.

  Client i from x with controls c, c_i: y <- x; per batch, the step of SGD with momentum on the corrected gradient
  g_i(y) - c_i + c; c_i+ = the mean of the K minibatch gradients g_i(y_k) along the path (option II's
  c_i - c + (x - y) / (K eta_l) when the momentum is 0); Delta_i = x - y. Server: x <- x - eta_g * aggregate(Delta_i)
  (the registry aggregator, weighted by example counts: the paper averages uniformly, a documented difference);
  c <- c + |S| / N * mean_i(c_i+ - c_i), unweighted.

  `uniform=True` weights the model updates equally (the paper's 1/|S|); `option_ii=True` computes c_i+ by option
  II's formula even with momentum. Both are alternatives the tests show to give different models here.
  """

  def __init__(self, model: Logistic, client: ClientConfig, aggregator: Aggregator, server: ServerSGD,
               population: int, uniform: bool = False, option_ii: bool = False):
    self.model, self.client, self.aggregator, self.server = model, client, aggregator, server
    self.population, self.uniform, self.option_ii = population, uniform, option_ii
    self.control = np.zeros(model.size)
    self.client_controls: dict[int, np.ndarray] = {}

  def round(self, theta: np.ndarray, client_data: Sequence[Batches], client_ids: Sequence[int]) -> np.ndarray:
    updates, control_deltas, weights = [], [], []
    for cid, data in zip(client_ids, client_data):
      c_i = self.client_controls.get(cid, np.zeros_like(theta))
      trained, gradients = sgdm_pass(theta, data, self.client.lr, self.client.momentum,
                                     self.model.loss_gradient, correction=self.control - c_i)
      new_c_i = np.mean(gradients, axis=0)
      if self.option_ii:
        new_c_i = c_i - self.control + (theta - trained) / (len(data) * self.client.lr)
      updates.append(theta - trained)
      control_deltas.append(new_c_i - c_i)
      weights.append(1 if self.uniform else num_examples(data))
      self.client_controls[cid] = new_c_i
    self.control = self.control + len(client_data) / self.population * np.mean(control_deltas, axis=0)
    return self.server.step(theta, self.aggregator(np.stack(updates), np.asarray(weights, np.float64)))


class PersonalizedRFA:
  """RFA paper, Algorithm 4: predictions with w + v_k; each selected device first trains its personal v_k with w
  fixed, then the shared w on the residual of the new v_k; the shared updates are aggregated by the geometric
  median. Each phase is one local pass of the client optimizer (fresh momentum) over the round's batches."""

  def __init__(self, model: Logistic, client: ClientConfig, aggregator: Aggregator, server: ServerSGD):
    self.model, self.client, self.aggregator, self.server = model, client, aggregator, server
    self.personal: dict[int, np.ndarray] = {}

  def round(self, theta: np.ndarray, client_data: Sequence[Batches], client_ids: Sequence[int]) -> np.ndarray:
    updates, weights = [], []
    for cid, data in zip(client_ids, client_data):
      v = self.personal.get(cid, np.zeros_like(theta))
      v = local_training(self.model, theta + v, data, self.client) - theta  # Phase 1: w fixed.
      shared = local_training(self.model, theta + v, data, self.client) - v  # Phase 2: v fixed.
      self.personal[cid] = v
      updates.append(theta - shared)
      weights.append(num_examples(data))
    return self.server.step(theta, self.aggregator(np.stack(updates), np.asarray(weights, np.float64)))
