"""NumPy models of the weighted means a factory can be given, on their first `next` call: a sound enclosure.

Every factory of `tff_gma.aggregators` that takes a `mean_factory` (GMA, RFA, FedGMA), and RFA's objective, reduces
to weighted means. These are models, written from TFF 0.87's source (`tensorflow_federated/python/...` in the venv,
paths below relative to it) and this project's docs (docs/methods.md), never from `tff_gma`'s code, of each inner
mean the property tests compose with, on the FIRST `next` call from `initialize()` (the adaptive bounds of TFF's
`robust_aggregator` / `secure_aggregator` / `compression_aggregator` are then their initial estimates, a function of
constants only). A model returns an `Enclosure`: per coordinate, an interval that the process's result must lie in,
whatever the float rounding and quantization, and the documented degenerate outcome (`ZERO`, `NONFINITE`) where the
weights are lost.

The inputs may themselves be intervals: each client's value coordinate in `[points_lo, points_hi]` and its weight in
`[weights_lo, weights_hi]`, because RFA's clients compute their Weiszfeld weights from an estimate that is only known
to lie in a box (`factories_reference.rfa`). With exact inputs (lo == hi) the enclosure is the model's own error.

How an enclosure is built (the bounds docs/methods.md can quote), with u the unit roundoff of the dtype (2**-24
float32, 2**-53 float64), N the clients in the round (all of them, weight 0 included: each is a summand) and
gamma_k(u) = k u / (1 - k u) (Higham, Accuracy and Stability of Numerical Algorithms, Lemma 3.1):

* Float sums (`FederatedMeanFactory`, TFF's `MeanFactory` with `SumFactory` sums, and the clipping/zeroing wrappers
  around it). The exact-arithmetic mean sum_i w_i p_i / sum_i w_i over the box of weights is a ratio of linear
  functions, extreme at a vertex where w_i is at its top for the points above the extreme and at its bottom for the
  others: `box_mean_range` tries the N + 1 such splits of the points sorted by value (exact, not a Lipschitz bound).
  To it is added the rounding of the sums: with A = the (box-maximal) weighted mean of |p| and |m| the largest
  |mean| in the box, |computed - exact| <= e1 + gamma_4(u) (|m| + e1), e1 = (gamma_{N+2}(u) A + gamma_{N+1}(u) |m|)
  / (1 - gamma_{N+1}(u)): numerator terms rounded at most twice (the weight's cast to the value's dtype, the product)
  and summed with N - 1 additions in any order (TFF's federated_sum is a federated_aggregate with `tf.add`,
  `core/environments/tensorflow_backend/tensorflow_tree_transformations.py`, `federated_sum`), the denominator
  summed the same way (or exactly, for integer weights), and at most four final roundings (FederatedMeanFactory's
  `federated_mean` is `sum(x * 1) / sum(1)` there, `federated_mean`, and it divides the two means: two divisions by
  N, a cast, a division). Products below the normal range add at most (N + 2) s / sum_i w_i, s the dtype's smallest
  subnormal.
* Quantized sums (`SecureWeightedMeanFactory`, TFF's `secure_aggregator`'s mean). `aggregators/primitives.py`
  `_client_tensor_shift_for_secure_sum` (lines 409-429): a float x clipped to [lo, hi] becomes the int64
  round(float64(x) * S) - round(lo * S), S = (2**32 - 1) / (hi - lo) in float64, clipped to [0, 2**32 - 1]; the
  server (`_server_tensor_shift_for_secure_sum`, 485-512) adds round(lo * S) N back, multiplies by (hi - lo) / (2**32
  - 1) in float64 and casts to the value's dtype. So each client's summand is off by at most one quantum (hi - lo) /
  (2**32 - 1) (half of it for the rounding, the rest covering the clip to [0, 2**32 - 1] at x = hi and the float64
  rounding of x * S; a full quantum keeps the bound simple), the float64 decoding adds at most 4 * 2**-53 relative,
  and the cast u. The weights' sum is an integer Q = sum_i round(w_i S_w) that the model computes exactly (it is
  the same IEEE float64 product and round-half-to-even, `tf.round`, as NumPy's) when the weights are exact, or as a
  range when they are intervals: Q = 0 is the documented degenerate outcome (the weights are below half a quantum,
  "lost"), 0 < Q a finite result; a range containing 0 and more is `AMBIGUOUS` (the caller rejects such an example).
  The result is the interval quotient of the numerator's interval and the denominator's.

A float-sum mean is `homogeneous` (multiplying every weight by one factor leaves it unchanged), so a caller whose
weights share an uncertain common factor (RFA's smoothing c' in b'_i = a_i c' / max(c', d'_i)) may pass the weights
divided by it (`weight_unit`); a quantized mean is not (its resolution is absolute) and gets the weights as sent.

The TFF factories modelled (`model_for`): `FederatedMeanFactory()`, `SecureWeightedMeanFactory(value_bound=B,
weight_bound=W)`, `tff.aggregators.MeanFactory()` (0 / 0 = NaN for zero total weight), `MeanFactory(
no_nan_division=True)`, `tff.learning.secure_aggregator(zeroing=False, clipping=False)`, `secure_aggregator()`,
`robust_aggregator()`, `compression_aggregator()`, `clipping_factory(C, MeanFactory())`, `zeroing_factory(Z,
MeanFactory())`; each model's docstring says where its numbers come from.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Optional

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
SECAGG_LEVELS = 2**32 - 1  # `_SECAGG_MAX`, aggregators/primitives.py line 186: the quantizer's top integer.
FLOAT64_DECODE = 4 * 2.0**-53  # The float64 roundings of the quantized sum's decoding (relative).

FINITE = 'finite'  # A finite result inside [lower, upper].
ZERO = 'zero'  # The result is exactly the zero update (the documented outcome of a zero total weight).
NONFINITE = 'nonfinite'  # The result is NaN or Inf (TFF's MeanFactory without no_nan_division: 0 / 0).
AMBIGUOUS = 'ambiguous'  # The inputs' uncertainty allows both a finite result and a degenerate one.


# ----------------------------------------------------------------------------------------------------------------
# Dtypes and layouts.


def unit_roundoff(dtype) -> float:
  """u = 2**-p for a float dtype with a p-bit significand (float16 11, bfloat16 8, float32 24, float64 53); 0 for
  integers (sums of small integers are exact)."""
  dtype = np.dtype(dtype)
  if dtype.kind in 'iu':
    return 0.0
  if dtype.name == 'bfloat16':
    return 2.0**-8
  return float(np.finfo(dtype).eps) / 2


def smallest_subnormal(dtype) -> float:
  dtype = np.dtype(dtype)
  if dtype.kind in 'iu':
    return 0.0
  if dtype.name == 'bfloat16':
    return 2.0**-133
  return float(np.finfo(dtype).smallest_subnormal)


def gamma(k: float, u) -> np.ndarray:
  """gamma_k(u) = k u / (1 - k u): the relative error of k roundings (Higham, Lemma 3.1)."""
  ku = k * np.asarray(u, np.float64)
  return ku / (1 - ku)


def float_weight_dtype(weight_dtype) -> np.dtype:
  """The float dtype a client weight is computed in: float64 for float64 weights, float32 for every other dtype (the
  rule of docs/methods.md, "Weight dtypes")."""
  return np.dtype(np.float64) if np.dtype(weight_dtype) == np.float64 else np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class Layout:
  """The leaves (shape, dtype) of a value structure, flattened in TFF's order into one vector of n coordinates."""
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[np.dtype, ...]

  @property
  def sizes(self) -> list[int]:
    return [int(math.prod(s)) for s in self.shapes]

  @property
  def n(self) -> int:
    return sum(self.sizes)

  @property
  def slices(self) -> list[slice]:
    out, start = [], 0
    for size in self.sizes:
      out.append(slice(start, start + size))
      start += size
    return out

  @property
  def coordinate_dtypes(self) -> list[np.dtype]:
    return [dtype for dtype, size in zip(self.dtypes, self.sizes) for _ in range(size)]

  @property
  def roundoff(self) -> np.ndarray:
    """u of each coordinate's dtype, [n]."""
    return np.array([unit_roundoff(d) for d in self.coordinate_dtypes])

  @property
  def subnormal(self) -> np.ndarray:
    return np.array([smallest_subnormal(d) for d in self.coordinate_dtypes])

  @property
  def single_dtype(self) -> bool:
    return len({np.dtype(d) for d in self.dtypes}) == 1

  def with_dtypes(self, dtype) -> 'Layout':
    return Layout(self.shapes, tuple(np.dtype(dtype) for _ in self.shapes))

  def compute_layout(self) -> 'Layout':
    """Float16 (and bfloat16) leaves as float32: the dtype RFA's passes work in (docs: "computed in float32")."""
    return Layout(self.shapes, tuple(np.dtype(np.float32) if unit_roundoff(d) > 2.0**-24 else np.dtype(d)
                                     for d in self.dtypes))

  def round(self, flat: np.ndarray) -> np.ndarray:
    """`flat` ([..., n]) rounded to each coordinate's dtype, back as float64."""
    flat = np.asarray(flat, np.float64)
    out = np.empty_like(flat)
    for sl, dtype in zip(self.slices, self.dtypes):
      out[..., sl] = np.asarray(flat[..., sl], dtype).astype(np.float64)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Enclosures.


@dataclasses.dataclass(frozen=True)
class Enclosure:
  """What a process's result (flattened, float64) must be: in [lower, upper] per coordinate, or the degenerate
  outcome `status` says; `center` is the model at the nominal inputs in exact arithmetic (NaN where NONFINITE)."""
  lower: np.ndarray
  upper: np.ndarray
  status: str
  center: np.ndarray

  @staticmethod
  def zero(n: int) -> 'Enclosure':
    z = np.zeros(n)
    return Enclosure(z, z, ZERO, z)

  @staticmethod
  def nonfinite(n: int) -> 'Enclosure':
    return Enclosure(np.full(n, -np.inf), np.full(n, np.inf), NONFINITE, np.full(n, np.nan))

  @staticmethod
  def ambiguous(n: int) -> 'Enclosure':
    return Enclosure(np.full(n, -np.inf), np.full(n, np.inf), AMBIGUOUS, np.full(n, np.nan))

  def contains(self, x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return (self.lower <= x) & (x <= self.upper)

  @property
  def width(self) -> np.ndarray:
    return self.upper - self.lower


def round_enclosure(enclosure: Enclosure, layout: Layout) -> Enclosure:
  """The enclosure of a result cast to `layout`'s dtypes: rounding to nearest is monotone, so the bounds round."""
  if enclosure.status != FINITE:
    return enclosure
  return Enclosure(layout.round(enclosure.lower), layout.round(enclosure.upper), FINITE, enclosure.center)


def box_mean_range(points_lo: np.ndarray, points_hi: np.ndarray, weights_lo: np.ndarray,
                   weights_hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The exact (min, max) per coordinate of sum_i w_i p_i / sum_i w_i over p_i in [points_lo, points_hi] ([N, n]) and
  w in the box [weights_lo, weights_hi] ([N], >= 0, some weights_hi > 0).

  The mean is increasing in every p_i (w_i >= 0), so the max takes p = points_hi; over the weights it is a ratio of
  linear functions, whose maximum over a box is at a vertex where w_i = hi_i exactly for the points above the maximum:
  one of the N + 1 splits of the points sorted in decreasing order (top k at hi, the rest at lo). The min is the max
  of the negated points. Float64 arithmetic: the caller adds a relative 2**-50 for its rounding.
  """
  lo_w, hi_w = np.asarray(weights_lo, np.float64), np.asarray(weights_hi, np.float64)
  return -_box_max(-np.asarray(points_lo, np.float64), lo_w, hi_w), _box_max(np.asarray(points_hi, np.float64),
                                                                            lo_w, hi_w)


def _box_max(points: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
  num_clients, n = points.shape
  best = np.full(n, -np.inf)
  for j in range(n):
    order = np.argsort(-points[:, j], kind='stable')
    p, low, high = points[order, j], lo[order], hi[order]
    top_num = np.concatenate([[0.0], np.cumsum(high * p)])  # k = 0..N: the first k at hi.
    top_den = np.concatenate([[0.0], np.cumsum(high)])
    rest_num = np.concatenate([np.cumsum((low * p)[::-1])[::-1], [0.0]])
    rest_den = np.concatenate([np.cumsum(low[::-1])[::-1], [0.0]])
    den = top_den + rest_den
    with np.errstate(invalid='ignore', divide='ignore'):
      candidates = np.where(den > 0, (top_num + rest_num) / np.where(den > 0, den, 1.0), -np.inf)
    best[j] = np.max(candidates) if num_clients else -np.inf
  return best


def interval_product(a_lo, a_hi, b_lo, b_hi) -> tuple[np.ndarray, np.ndarray]:
  products = np.stack([a_lo * b_lo, a_lo * b_hi, a_hi * b_lo, a_hi * b_hi])
  return products.min(axis=0), products.max(axis=0)


def interval_quotient(a_lo, a_hi, b_lo, b_hi) -> tuple[np.ndarray, np.ndarray]:
  """[a] / [b] for b_lo > 0."""
  assert np.all(b_lo > 0), b_lo
  quotients = np.stack([a_lo / b_lo, a_lo / b_hi, a_hi / b_lo, a_hi / b_hi])
  return quotients.min(axis=0), quotients.max(axis=0)


def widen(lo: np.ndarray, hi: np.ndarray, relative, absolute=0.0) -> tuple[np.ndarray, np.ndarray]:
  """[lo, hi] grown by `relative` times the largest magnitude in it, plus `absolute`."""
  magnitude = np.maximum(np.abs(lo), np.abs(hi))
  return lo - relative * magnitude - absolute, hi + relative * magnitude + absolute


# ----------------------------------------------------------------------------------------------------------------
# Value transforms before the mean: TFF's zeroing and clipping wrappers (aggregators/robust.py).


@dataclasses.dataclass(frozen=True)
class ZeroingLinf:
  """`tff.aggregators.zeroing_factory(Z, inner)` with its default `norm_order=math.inf` (robust.py line 192).

  `zero_fn` (lines 257-272): global_norm = max over leaves of float32(tf.norm(leaf, ord=inf)) (`_global_inf_norm`,
  line 454: the max |x| of the leaf, exact, cast to float32), and the whole value becomes zeros when global_norm >
  Z (strict, float32). The weight is unchanged (the docstring: "if some value is zeroed, the weight is unchanged"),
  so a zeroed client pulls the mean towards 0. The decision is computed exactly here (the same float32 cast and
  comparison), so it adds no error.
  """
  threshold: float

  def apply(self, points: np.ndarray, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    """(transformed points, relative error of each transformed coordinate) for exact `points` [N, n]."""
    norms = np.zeros(len(points), np.float32)
    for sl in layout.slices:
      leaf_max = np.max(np.abs(points[:, sl]), axis=1) if sl.stop > sl.start else np.zeros(len(points))
      norms = np.maximum(norms, leaf_max.astype(np.float32))
    zeroed = norms > np.float32(self.threshold)
    return np.where(zeroed[:, None], 0.0, points), np.zeros_like(points)


@dataclasses.dataclass(frozen=True)
class ClipL2:
  """`tff.aggregators.clipping_factory(C, inner)`: the whole value scaled to global L2 norm at most C.

  `_clip_by_global_l2_norm` (robust.py lines 473-486): global_norm = sqrt(sum over leaves of float32(tf.norm(leaf)
  ** 2)) in float32 (`_global_l2_norm`, line 461); when global_norm > C the value is divided by float32(global_norm /
  C) cast to each leaf's dtype. Model: T(x) = x min(1, C / ||x||). The computed norm is within nu = (n + 8) u32 of
  ||x|| (n squares summed, a square root, the `** 2` and the cast, doubled for safety), so the computed T'(x) is
  within rho = nu + 4 u of T(x) relatively, whether or not the rounding flips the decision near ||x|| = C (both
  sides then differ from T(x) by a factor within [1 / (1 + nu), 1]); below C (1 - 2 nu) the value is not clipped
  and passes exactly. (float16 leaves would square-overflow in tf.norm; they are not modelled.)
  """
  threshold: float

  def apply(self, points: np.ndarray, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    assert all(unit_roundoff(d) <= 2.0**-24 for d in layout.dtypes), 'clipping of float16 values is not modelled'
    u32 = 2.0**-24
    nu = (layout.n + 8) * u32
    norms = np.linalg.norm(points, axis=1)
    with np.errstate(divide='ignore', invalid='ignore'):
      scale = np.where(norms > self.threshold, self.threshold / np.where(norms > 0, norms, 1.0), 1.0)
    transformed = points * scale[:, None]
    near = norms >= self.threshold * (1 - 2 * nu)
    rho = np.where(near[:, None], 1.01 * (nu + 4 * np.maximum(layout.roundoff[None, :], u32)), 0.0)
    return transformed, np.broadcast_to(rho, points.shape).copy()


def apply_transforms(transforms: Sequence, points_lo: np.ndarray, points_hi: np.ndarray, layout: Layout):
  """The wrappers' transforms in order (outermost first, as TFF applies them), as point intervals."""
  if not transforms:
    return points_lo, points_hi
  assert np.array_equal(points_lo, points_hi), 'the wrappers are modelled for exact client values'
  points, rho = points_lo, np.zeros_like(points_lo)
  for transform in transforms:
    points, more = transform.apply(points, layout)
    rho = rho + more + rho * more
  return points - rho * np.abs(points), points + rho * np.abs(points)


# ----------------------------------------------------------------------------------------------------------------
# The models.


@dataclasses.dataclass(frozen=True)
class FloatSumMean:
  """A weighted mean whose sums are plain float sums: `FederatedMeanFactory` and TFF's `MeanFactory`.

  `FederatedMeanFactory` (docs/methods.md, "The weighted means, plain and secure"): the weight cast to float
  (float32, float64 for float64 weights), the pair (a_i w_i, a_i) to one `federated_mean`, their quotient; zeros for
  zero total weight. TFF's `MeanFactory` (aggregators/mean.py, `_mul` line 265, `_div` 270, `_div_no_nan` 278): the
  weight as given cast to the value's dtype and multiplied in, both sums by `SumFactory` (`federated_sum`), the
  quotient by `tf.math.divide` (0 / 0 = NaN: `zero_weight=NONFINITE`) or `divide_no_nan` (`no_nan_division=True`:
  ZERO). `transforms` are the clipping/zeroing wrappers applied to the values first (`ZeroingLinf`, `ClipL2`).
  """
  name: str
  zero_weight: str  # ZERO or NONFINITE: the result for a zero total weight.
  float_weights: bool  # True: this library's FederatedMeanFactory (float weights; float16/bfloat16 in float32).
  transforms: tuple = ()
  # The result does not change when every weight is multiplied by one factor (the caller may then give the weights
  # divided by a common factor, `weight_unit`: RFA's smoothing c, which cancels).
  homogeneous = True

  def refusal(self, layout: Layout, weight_dtype) -> Optional[str]:
    del weight_dtype
    if not self.float_weights and any(np.dtype(d) == BFLOAT16 for d in layout.dtypes):
      return "TFF's MeanFactory takes no bfloat16 (aggregators/mean.py `_check_value_type`)"
    return None

  def weight_sum_roundoff(self, layout: Layout, weight_dtype) -> float:
    if self.float_weights:  # FederatedMeanFactory's pair weight: float64 with a float64 leaf, else the float weight.
      float64_leaf = any(np.dtype(d) == np.float64 for d in layout.dtypes)
      return unit_roundoff(np.float64 if float64_leaf else float_weight_dtype(weight_dtype))
    return unit_roundoff(weight_dtype)

  def mean(self, points_lo, points_hi, weights_lo, weights_hi, layout: Layout, weight_dtype,
           nominal_points=None, nominal_weights=None, weight_unit: float = 1.0) -> Enclosure:
    """The enclosure of the first call's result for values in [points_lo, points_hi] ([N, n], the values as the
    process receives them) and weights in [weights_lo, weights_hi] ([N], as received, >= 0; or those divided by
    the common factor `weight_unit`, which only the bound on products below the normal range needs)."""
    if self.float_weights and layout.compute_layout() != layout:  # float16/bfloat16: in float32, cast back.
      return round_enclosure(self.mean(points_lo, points_hi, weights_lo, weights_hi, layout.compute_layout(),
                                       weight_dtype, nominal_points, nominal_weights, weight_unit), layout)
    assert self.float_weights or all(unit_roundoff(d) <= 2.0**-24 for d in layout.dtypes), (
        "TFF's MeanFactory on float16 values (the weight cast to float16) is not modelled")
    n = layout.n
    weights_lo, weights_hi = np.asarray(weights_lo, np.float64), np.asarray(weights_hi, np.float64)
    if not np.any(weights_hi > 0):
      return Enclosure.zero(n) if self.zero_weight == ZERO else Enclosure.nonfinite(n)
    if not np.sum(weights_lo) > 0:
      return Enclosure.ambiguous(n)
    p_lo, p_hi = apply_transforms(self.transforms, np.asarray(points_lo, np.float64),
                                  np.asarray(points_hi, np.float64), layout)
    lo, hi = box_mean_range(p_lo, p_hi, weights_lo, weights_hi)
    num_clients = len(weights_lo)
    u_t = layout.roundoff
    u_max = np.maximum(u_t, self.weight_sum_roundoff(layout, weight_dtype))
    absolute = np.maximum(np.abs(p_lo), np.abs(p_hi))
    mean_abs_value = _box_max(absolute, weights_lo, weights_hi)  # A: the largest weighted mean of |p| in the box.
    mean_abs = np.maximum(np.abs(lo), np.abs(hi))
    rel_den = gamma(num_clients + 1, u_max)
    e1 = (gamma(num_clients + 2, u_t) * mean_abs_value + rel_den * mean_abs) / (1 - rel_den)
    underflow = (num_clients + 2) * layout.subnormal / (np.sum(weights_lo) * weight_unit)
    error = e1 + gamma(4, u_max) * (mean_abs + e1) + underflow
    lo, hi = widen(lo, hi, 2.0**-50, error)
    center = self.center(points_lo if nominal_points is None else nominal_points,
                         weights_lo if nominal_weights is None else nominal_weights, layout)
    return Enclosure(lo, hi, FINITE, center)

  def center(self, points, weights, layout: Layout) -> np.ndarray:
    points, weights = np.asarray(points, np.float64), np.asarray(weights, np.float64)
    for transform in self.transforms:
      points, _ = transform.apply(points, layout)
    return weights @ points / weights.sum() if weights.sum() > 0 else np.zeros(layout.n)


@dataclasses.dataclass(frozen=True)
class QuantizedMean:
  """A weighted mean through TFF's quantized secure sum (aggregators/primitives.py `secure_quantized_sum`).

  kind='secure_weighted_mean': this project's `SecureWeightedMeanFactory(value_bound=B, weight_bound=W)`
  (docs/methods.md, "The secure mean"): the weight cast to float, clipped to [0, W] and normalized, u_i = a_i / W
  (one float rounding documented; two allowed, for TF's division by a constant as a product with the constant's
  reciprocal); each coordinate clipped to [-B, B] and multiplied by u_i (the cast of u_i to the value's
  dtype and the product: two more); the pair (u_i w_i, u_i) to one quantized sum with bounds [-B, B] per leaf and
  [0, 1]; the quotient with `divide_no_nan` (ZERO when the normalized weights quantize to 0).

  kind='tff_secure': the mean inside `tff.learning.secure_aggregator` (learning/model_update_aggregator.py lines
  296-318): `MeanFactory(value_sum_factory=SecureSumFactory(bound), weight_sum_factory=SecureSumFactory(
  upper_bound_threshold=float(2**20 - 1), lower_bound_threshold=0.0))`, no_nan_division=False. The value bound is a
  `PrivateQuantileEstimationProcess.no_noise(initial_estimate=50.0, ..., multiplier=2.0)` (lines 296-303), so
  on the first call it is 2 * 50 = 100 (aggregators/quantile_estimation.py line 201, the affine report), and the
  lower bound is its negative (aggregators/secure.py line 635, `x * -1.0`). The weighted value a_i w_i (the weight
  cast to the value's dtype, `_mul`) is clipped to [-100, 100] before quantization, so a large weight clips the
  weighted value: not a mean of the values then, and not scale-invariant in the weights, which this models. The
  weights are clipped to [0, 2**20 - 1] and quantized with S_w = (2**32 - 1) / (2**20 - 1), a quantum of about
  2.44e-4: weights below half of it are lost; Q = 0 makes the quotient 0 / 0 = NaN (`tf.math.divide`, mean.py
  line 272). `SecureSumFactory` accepts only a structure of one dtype (secure.py line 501) and float weights for the
  float bounds (line 517); `secure_quantized_sum` refuses dtypes other than int32, int64, float32 and float64
  (primitives.py line 178): the refusals `refusal` predicts.

  `transforms`: the wrappers `secure_aggregator()` puts around it (`ZeroingLinf(21)`, `ClipL2(1)`: `_default_zeroing`
  and `_default_clipping`, lines 35-86, with `secure_estimation=True`, whose first-call norms are those of
  `robust_aggregator`).
  """
  name: str
  kind: str  # 'secure_weighted_mean' or 'tff_secure'.
  value_bound: float
  weight_bound: float
  transforms: tuple = ()
  homogeneous = False  # The quantization's resolution is absolute (and tff_secure clips the weighted values).

  def refusal(self, layout: Layout, weight_dtype) -> Optional[str]:
    if self.kind == 'tff_secure' and any(unit_roundoff(d) > 2.0**-24 for d in layout.dtypes):
      return 'secure_quantized_sum takes float32 and float64 values only (primitives.py line 178)'
    if self.kind == 'tff_secure':
      if not layout.single_dtype:
        return 'SecureSumFactory takes a structure of one dtype only'
      if np.dtype(weight_dtype).kind in 'iu':
        return "secure_aggregator's weight SecureSumFactory has float bounds and takes float weights only"
    return None

  def _value_bounds(self, layout: Layout) -> np.ndarray:
    """The value's clip bound per coordinate, as the dtype holds it."""
    bound = self.value_bound if self.kind == 'secure_weighted_mean' else 100.0
    return layout.round(np.full(layout.n, bound))

  def _weight_dtype(self, weight_dtype) -> np.dtype:
    return float_weight_dtype(weight_dtype) if self.kind == 'secure_weighted_mean' else np.dtype(weight_dtype)

  def _weight_terms(self, weights: np.ndarray, weight_dtype) -> np.ndarray:
    """What each client feeds the weights' quantizer, computed as the process does (exact inputs)."""
    dtype = self._weight_dtype(weight_dtype)
    w = np.asarray(weights, dtype)
    if self.kind == 'secure_weighted_mean':
      bound = np.asarray(self.weight_bound, dtype)
      return (np.clip(w, np.asarray(0, dtype), bound) / bound).astype(np.float64)  # u_i = a_i / W in `dtype`.
    return np.clip(w, np.asarray(0, dtype), np.asarray(2.0**20 - 1, dtype)).astype(np.float64)

  def _weight_scale(self, weight_dtype) -> float:
    """S_w = (2**32 - 1) / (hi - lo) of the weights' quantizer, in float64 as TFF computes it."""
    if self.kind == 'secure_weighted_mean':
      return float(np.float64(SECAGG_LEVELS) / np.float64(1.0))
    span = np.float64(np.asarray(2.0**20 - 1, self._weight_dtype(weight_dtype)))
    return float(np.float64(SECAGG_LEVELS) / span)

  def mean(self, points_lo, points_hi, weights_lo, weights_hi, layout: Layout, weight_dtype,
           nominal_points=None, nominal_weights=None) -> Enclosure:
    if layout.compute_layout() != layout:  # float16/bfloat16 (this library's secure mean): in float32, cast back.
      assert self.kind == 'secure_weighted_mean'
      return round_enclosure(self.mean(points_lo, points_hi, weights_lo, weights_hi, layout.compute_layout(),
                                       weight_dtype, nominal_points, nominal_weights), layout)
    n, num_clients = layout.n, len(weights_lo)
    weights_lo, weights_hi = np.asarray(weights_lo, np.float64), np.asarray(weights_hi, np.float64)
    wd = self._weight_dtype(weight_dtype)
    u_w, u_t = unit_roundoff(wd), layout.roundoff
    scale = self._weight_scale(weight_dtype)
    # The weights' integer sum Q: exact for exact weights fed to the quantizer as they are (tff_secure), a range
    # otherwise (round is nondecreasing). The secure mean's u_i = a_i / W is not replicated bit for bit: TF may
    # compute a division by the constant W as a product with its float32 reciprocal (two roundings, seen here).
    if np.array_equal(weights_lo, weights_hi) and self.kind == 'tff_secure':
      terms = self._weight_terms(weights_lo, weight_dtype)
      q_lo = q_hi = float(np.sum(np.round(terms * scale)))
      terms_lo = terms_hi = terms
    else:
      terms_lo = self._weight_terms_bound(weights_lo, wd, -1)
      terms_hi = self._weight_terms_bound(weights_hi, wd, +1)
      q_lo = float(np.sum(np.round(terms_lo * scale * (1 - 2.0**-52))))
      q_hi = float(np.sum(np.round(terms_hi * scale * (1 + 2.0**-52))))
    if q_hi == 0:
      return Enclosure.zero(n) if self.kind == 'secure_weighted_mean' else Enclosure.nonfinite(n)
    if q_lo == 0:
      return Enclosure.ambiguous(n)
    # The numerator: each client's summand as an interval, clipped as the process clips it, then quantized.
    p_lo, p_hi = apply_transforms(self.transforms, np.asarray(points_lo, np.float64),
                                  np.asarray(points_hi, np.float64), layout)
    bounds = self._value_bounds(layout)
    if self.kind == 'secure_weighted_mean':
      x_lo, x_hi = np.clip(p_lo, -bounds, bounds), np.clip(p_hi, -bounds, bounds)
      # u_i cast to the value's dtype (a rounding when the weight is float64 and the value float32), the product.
      cast = np.where(u_t < u_w, u_t, 0.0) if u_w > 0 else np.zeros_like(u_t)
      t_lo, t_hi = interval_product(x_lo, x_hi, terms_lo[:, None], terms_hi[:, None])
      t_lo, t_hi = widen(t_lo, t_hi, cast + u_t + cast * u_t)
    else:
      # The weight cast to the value's dtype (exact for float32 weights and values), the product, then the clip.
      cast = np.where(u_t < u_w, u_t, 0.0)
      t_lo, t_hi = interval_product(p_lo, p_hi, weights_lo[:, None], weights_hi[:, None])
      t_lo, t_hi = widen(t_lo, t_hi, cast + u_t + cast * u_t)
      t_lo, t_hi = np.clip(t_lo, -bounds, bounds), np.clip(t_hi, -bounds, bounds)
    quantum = 2 * bounds / SECAGG_LEVELS
    v_lo, v_hi = t_lo.sum(axis=0) - num_clients * quantum, t_hi.sum(axis=0) + num_clients * quantum
    v_lo, v_hi = widen(v_lo, v_hi, FLOAT64_DECODE + u_t)  # The decoding in float64, the cast to the value's dtype.
    # The denominator: Q / S_w decoded in float64, cast to the weight's dtype and then to the value's.
    d_lo = q_lo / scale * (1 - FLOAT64_DECODE) * (1 - u_w) * (1 - u_t)
    d_hi = q_hi / scale * (1 + FLOAT64_DECODE) * (1 + u_w) * (1 + u_t)
    lo, hi = interval_quotient(v_lo, v_hi, np.full(n, d_lo), np.full(n, d_hi))
    lo, hi = widen(lo, hi, u_t + 2.0**-50)  # The division's rounding.
    center = self.center(points_lo if nominal_points is None else nominal_points,
                         weights_lo if nominal_weights is None else nominal_weights, layout, weight_dtype)
    return Enclosure(lo, hi, FINITE, center)

  def _weight_terms_bound(self, weights: np.ndarray, dtype: np.dtype, direction: int) -> np.ndarray:
    """A bound (direction -1: below, +1: above) on `_weight_terms` for weights within the box's edge `weights`."""
    u_w = unit_roundoff(dtype)
    if self.kind == 'secure_weighted_mean':
      clipped = np.clip(weights, 0.0, self.weight_bound)
      return clipped / self.weight_bound * (1 + direction * 3 * u_w)
    return np.clip(weights, 0.0, 2.0**20 - 1) * (1 + direction * u_w)

  def center(self, points, weights, layout: Layout, weight_dtype) -> np.ndarray:
    """The model in exact arithmetic, without quantization."""
    points, weights = np.asarray(points, np.float64), np.asarray(weights, np.float64)
    for transform in self.transforms:
      points, _ = transform.apply(points, layout)
    bounds = self._value_bounds(layout)
    if self.kind == 'secure_weighted_mean':
      u = np.clip(weights, 0.0, self.weight_bound) / self.weight_bound
      return u @ np.clip(points, -bounds, bounds) / u.sum() if u.sum() > 0 else np.zeros(layout.n)
    w = np.clip(weights, 0.0, 2.0**20 - 1)
    return np.clip(w[:, None] * points, -bounds, bounds).sum(axis=0) / w.sum()


# ----------------------------------------------------------------------------------------------------------------
# The inner factories by name.

ROBUST_ZEROING_NORM = 2.0 * 10.0 + 1.0  # `_default_zeroing`: initial_estimate 10, multiplier 2, increment 1 (35-60).
ROBUST_CLIPPING_NORM = 1.0  # `_default_clipping`: initial_estimate 1.0, no affine map (63-86).
CLIPPING_NORM = 3.0  # The constant C of `clipping_factory(C, MeanFactory())` in the tests.
ZEROING_NORM = 50.0  # The constant Z of `zeroing_factory(Z, MeanFactory())` in the tests.

_ROBUST = (ZeroingLinf(ROBUST_ZEROING_NORM), ClipL2(ROBUST_CLIPPING_NORM))

INNER_NAMES = (
    'federated_mean',  # tff_gma.aggregators.FederatedMeanFactory()
    'secure_weighted_mean',  # tff_gma.aggregators.SecureWeightedMeanFactory(value_bound=B, weight_bound=W)
    'tff_mean',  # tff.aggregators.MeanFactory()
    'tff_mean_no_nan',  # tff.aggregators.MeanFactory(no_nan_division=True)
    'tff_secure_plain',  # tff.learning.secure_aggregator(zeroing=False, clipping=False)
    'tff_secure',  # tff.learning.secure_aggregator()
    'tff_robust',  # tff.learning.robust_aggregator()
    'tff_compression',  # tff.learning.compression_aggregator()
    'tff_clipping',  # tff.aggregators.clipping_factory(CLIPPING_NORM, tff.aggregators.MeanFactory())
    'tff_zeroing',  # tff.aggregators.zeroing_factory(ZEROING_NORM, tff.aggregators.MeanFactory())
)


def model_for(name: str, value_bound: float = 10.0, weight_bound: float = 1e4):
  """The model of the inner factory `name` (`INNER_NAMES`), on its first call.

  `compression_aggregator()` is `robust_aggregator()`'s wrappers around `MeanFactory(EncodedSumFactory.
  quantize_above_threshold(quantization_bits=8, threshold=20000))` (model_update_aggregator.py lines 234-240): a
  tensor of at most 20000 elements gets the identity encoder (aggregators/encoded.py lines 117-123), i.e. a plain
  sum, so on the tests' small tensors it is `robust_aggregator()`.
  """
  if name == 'federated_mean':
    return FloatSumMean(name, ZERO, float_weights=True)
  if name == 'secure_weighted_mean':
    return QuantizedMean(name, 'secure_weighted_mean', value_bound, weight_bound)
  if name == 'tff_mean':
    return FloatSumMean(name, NONFINITE, float_weights=False)
  if name == 'tff_mean_no_nan':
    return FloatSumMean(name, ZERO, float_weights=False)
  if name == 'tff_secure_plain':
    return QuantizedMean(name, 'tff_secure', 100.0, 2.0**20 - 1)
  if name == 'tff_secure':
    return QuantizedMean(name, 'tff_secure', 100.0, 2.0**20 - 1, _ROBUST)
  if name in ('tff_robust', 'tff_compression'):
    return FloatSumMean(name, NONFINITE, float_weights=False, transforms=_ROBUST)
  if name == 'tff_clipping':
    return FloatSumMean(name, NONFINITE, float_weights=False, transforms=(ClipL2(CLIPPING_NORM),))
  if name == 'tff_zeroing':
    return FloatSumMean(name, NONFINITE, float_weights=False, transforms=(ZeroingLinf(ZEROING_NORM),))
  raise ValueError(f'unknown inner mean {name!r}')
