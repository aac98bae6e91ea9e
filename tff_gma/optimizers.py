"""FedAdam's and FedYogi's server optimizers as Reddi et al. define them, as `tff.learning.optimizers.Optimizer`s.

Reddi et al. 2021's Algorithm 2, which the GMA paper's FedAdam and FedYogi follow: moments from m = 0 and v = tau^2,
no bias correction. TFF 0.87's `build_adam` / `build_yogi` add Adam's bias correction (steps 0.47 to 1 times these
over the rounds the papers run) and start v elsewhere. State and hyperparameters are shaped as TFF's, so TFF's
finalizers use them unchanged.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
import math
import numbers
from typing import Any

import tensorflow as tf
import tensorflow_federated as tff

LEARNING_RATE = tff.learning.optimizers.LEARNING_RATE_KEY  # 'learning_rate', TFF's key.
BETA_1 = 'beta_1'
BETA_2 = 'beta_2'
EPSILON = 'epsilon'
FIRST_MOMENT = 'first_moment'  # Reddi's m_t.
SECOND_MOMENT = 'second_moment'  # Reddi's v_t.
HPARAMS_KEYS = (LEARNING_RATE, BETA_1, BETA_2, EPSILON)

# The GMA paper's values (Sec. 5, "as per Reddi et al."), and the project's adaptivity tau.
DEFAULT_BETA_1 = 0.9
DEFAULT_BETA_2 = 0.99
DEFAULT_EPSILON = 1e-3


# ----------------------------------------------------------------------------------------------------------------
# The second-moment rules, in plain TF: (v_{t-1}, g^2, beta_2) -> v_t.


def adam_second_moment(v, squared_gradient, beta_2):
  """FedAdam: an exponential moving average of the squared update."""
  return beta_2 * v + (1.0 - beta_2) * squared_gradient


def yogi_second_moment(v, squared_gradient, beta_2):
  """FedYogi: v moves towards the squared update by (1 - beta_2) g^2, additively (not by a share of v - g^2)."""
  return v - (1.0 - beta_2) * squared_gradient * tf.sign(v - squared_gradient)


SecondMomentRule = Callable[[Any, Any, Any], Any]


def _as_dtype(value, dtype: tf.DType):
  """A hyperparameter in the weights' dtype: a Python number converted directly (`tf.cast` of a Python float would
  round it through float32 first), a tensor cast."""
  return tf.cast(value, dtype) if tf.is_tensor(value) else tf.constant(value, dtype)


def _check_hparam(value, name: str, low: float, high: float, *, low_open: bool = False,
                  high_open: bool = False) -> None:
  """A finite real number between `low` and `high` (each end open or closed), else a ValueError naming it. A
  tensor (a hyperparameter traced inside a computation) is not checked."""
  if tf.is_tensor(value):
    return
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
    raise ValueError(f'{name} must be a finite number, got {value!r}')
  if value < low or (low_open and value == low) or value > high or (high_open and value == high):
    interval = f'{"(" if low_open else "["}{low:g}, {high:g}{")" if high_open else "]"}'
    raise ValueError(f'{name} must lie in {interval}, got {value!r}')


class ReddiAdaptiveOptimizer(tff.learning.optimizers.Optimizer):
  """Reddi et al.'s Algorithm 2 server step with a second-moment rule (Adam's or Yogi's).

  Round t, with Delta_t the aggregated client update (the mean of y_i - x_t), from m_{-1} = 0 and v_{-1} = tau^2
  (tau = `epsilon`), with no bias correction:

      m_t     = beta_1 m_{t-1} + (1 - beta_1) Delta_t
      v_t     = beta_2 v_{t-1} + (1 - beta_2) Delta_t^2                         (FedAdam)
      v_t     = v_{t-1} - (1 - beta_2) Delta_t^2 sign(v_{t-1} - Delta_t^2)      (FedYogi)
      x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)

  TFF's client works send x_t - y_i = -Delta_t and `next` steps against what it is given, as every TFF optimizer:
  m of -Delta is -m of Delta and v sees only squares, so fed TFF's update it moves x_t by +eta m_t / (...), as
  Algorithm 2 does. The state is an `OrderedDict` of the hyperparameters (`learning_rate`, `beta_1`, `beta_2`,
  `epsilon`; `get_hparams`/`set_hparams`) and the moments (`first_moment`, `second_moment`, each the structure of
  the weights). v starts at the tau^2 of `initialize`; an `epsilon` set later through `set_hparams` changes the
  denominator from then on, not v's start.

  Build it with `build_reddi_adam` or `build_reddi_yogi`.
  """

  def __init__(self, second_moment_rule: SecondMomentRule, learning_rate: float, beta_1: float = DEFAULT_BETA_1,
               beta_2: float = DEFAULT_BETA_2, epsilon: float = DEFAULT_EPSILON, *, name: str = 'optimizer'):
    _check_hparam(learning_rate, f'{name} learning_rate', 0.0, math.inf)
    # Reddi et al.: beta_1, beta_2 in [0, 1) (at 1, m or v would never move from its start).
    _check_hparam(beta_1, f'{name} beta_1', 0.0, 1.0, high_open=True)
    _check_hparam(beta_2, f'{name} beta_2', 0.0, 1.0, high_open=True)
    # tau > 0: v starts at tau^2 > 0, so a coordinate whose updates are all 0 steps by 0 / (tau + tau), not 0 / 0.
    _check_hparam(epsilon, f'{name} epsilon', 0.0, math.inf, low_open=True)
    self._second_moment_rule = second_moment_rule
    self._hparams = collections.OrderedDict(
        [(LEARNING_RATE, learning_rate), (BETA_1, beta_1), (BETA_2, beta_2), (EPSILON, epsilon)])

  def initialize(self, specs: Any) -> collections.OrderedDict:
    """The hyperparameters, m_{-1} = 0 and v_{-1} = epsilon^2 (Algorithm 2's v_{-1} >= tau^2, at equality)."""
    epsilon = self._hparams[EPSILON]
    first_moment = tf.nest.map_structure(lambda s: tf.zeros(s.shape, s.dtype), specs)
    second_moment = tf.nest.map_structure(
        lambda s: tf.fill(s.shape, tf.square(_as_dtype(epsilon, s.dtype))), specs)
    return collections.OrderedDict([*self._hparams.items(), (FIRST_MOMENT, first_moment),
                                    (SECOND_MOMENT, second_moment)])

  def next(self, state: collections.OrderedDict, weights: Any, gradients: Any) -> tuple[collections.OrderedDict, Any]:
    """One round: the moments updated with `gradients` (TFF's update, -Delta_t), then the weights stepped."""
    gradients = tff.learning.optimizers.handle_indexed_slices_gradients(gradients)
    tff.learning.optimizers.check_weights_gradients_match(weights, gradients)
    for key in (FIRST_MOMENT, SECOND_MOMENT):
      try:
        tf.nest.assert_same_structure(weights, state[key], check_types=True)
        for w, moment in zip(tf.nest.flatten(weights), tf.nest.flatten(state[key])):
          if not tf.TensorShape(w.shape).is_compatible_with(moment.shape) or tf.as_dtype(w.dtype) != moment.dtype:
            raise ValueError(f'a weight of shape {w.shape} and dtype {w.dtype} against a moment of shape '
                             f'{moment.shape} and dtype {moment.dtype}')
      except (TypeError, ValueError) as e:
        raise ValueError(f'the optimizer state\'s {key} does not match the weights (was `initialize` given specs '
                         f'of other weights?): {e}') from None
    learning_rate, beta_1, beta_2, epsilon = (state[k] for k in HPARAMS_KEYS)

    def step(w, m, v, g):
      if g is None:  # As TFF's optimizers (and Keras'): a weight without a gradient is left as it is.
        return w, m, v
      cast = lambda x: _as_dtype(x, w.dtype)
      m = cast(beta_1) * m + (1.0 - cast(beta_1)) * g
      v = self._second_moment_rule(v, tf.square(g), cast(beta_2))
      w = w - cast(learning_rate) * m / (tf.sqrt(v) + cast(epsilon))
      return w, m, v

    stepped = [step(*leaves) for leaves in zip(tf.nest.flatten(weights), tf.nest.flatten(state[FIRST_MOMENT]),
                                               tf.nest.flatten(state[SECOND_MOMENT]), tf.nest.flatten(gradients))]
    new_weights, new_m, new_v = ([leaf[i] for leaf in stepped] for i in range(3))
    new_state = collections.OrderedDict([
        *((k, state[k]) for k in HPARAMS_KEYS),
        (FIRST_MOMENT, tf.nest.pack_sequence_as(state[FIRST_MOMENT], new_m)),
        (SECOND_MOMENT, tf.nest.pack_sequence_as(state[SECOND_MOMENT], new_v))])
    return new_state, tf.nest.pack_sequence_as(weights, new_weights)

  def get_hparams(self, state: collections.OrderedDict) -> collections.OrderedDict:
    return collections.OrderedDict((k, state[k]) for k in HPARAMS_KEYS)

  def set_hparams(self, state: collections.OrderedDict, hparams: collections.OrderedDict) -> collections.OrderedDict:
    unknown = sorted(set(hparams) - set(HPARAMS_KEYS))
    if unknown:
      raise ValueError(f'hparams: unknown hyperparameters {unknown}; expected some of {list(HPARAMS_KEYS)}')
    return collections.OrderedDict((k, hparams.get(k, v)) for k, v in state.items())


def build_reddi_adam(learning_rate: float, beta_1: float = DEFAULT_BETA_1, beta_2: float = DEFAULT_BETA_2,
                     epsilon: float = DEFAULT_EPSILON) -> tff.learning.optimizers.Optimizer:
  """FedAdam's server optimizer, Reddi et al.'s Algorithm 2 (no bias correction, v from epsilon^2).

  Args:
    learning_rate: eta, the server learning rate (>= 0).
    beta_1: the first moment's decay, in [0, 1) (GMA paper: 0.9).
    beta_2: the second moment's decay, in [0, 1) (GMA paper: 0.99).
    epsilon: tau, the adaptivity (> 0): the denominator's constant and sqrt of v's start.

  Raises:
    ValueError: an argument out of its range (the message names it).
  """
  return ReddiAdaptiveOptimizer(adam_second_moment, learning_rate, beta_1, beta_2, epsilon, name='build_reddi_adam')


def build_reddi_yogi(learning_rate: float, beta_1: float = DEFAULT_BETA_1, beta_2: float = DEFAULT_BETA_2,
                     epsilon: float = DEFAULT_EPSILON) -> tff.learning.optimizers.Optimizer:
  """FedYogi's server optimizer, Reddi et al.'s Algorithm 2 (no bias correction, v from epsilon^2); arguments as
  `build_reddi_adam`'s.

  Raises:
    ValueError: an argument out of its range (the message names it).
  """
  return ReddiAdaptiveOptimizer(yogi_second_moment, learning_rate, beta_1, beta_2, epsilon, name='build_reddi_yogi')
