"""NumPy references of the public factories of `tff_gma.aggregators`, composed with any inner mean (`inner_means`).

Written from the papers and docs/methods.md ("GMA's factory and its math", "RFA's factory and the smoothed Weiszfeld
algorithm", "The weighted means, plain and secure", "Elastic aggregation", "FedGMA"), not from `tff_gma`'s code.
Each reference returns what the factory's first `next` call must give: an `inner_means.Enclosure` of the result
(flattened, float64) and the measurements it must report, exact or as intervals. The enclosures are sound, not
tolerances: each step's float rounding and quantization is bounded (`inner_means`' module docstring), and RFA's
passes are propagated as boxes (`rfa`), so a result outside an enclosure is a wrong result, not a loose test.

Values travel as `Clients`: an [N, n] float64 matrix of the clients' flattened values (each exactly representable in
its leaf's dtype, `Layout`), the weights as given, and their dtype. The documented client preparation (docs/methods.md,
"Non-finite input" and "Weight dtypes"): the weight is cast to float (float32; float64 stays float64), and a client
whose value has a NaN or Inf, whose squared norm overflows float32, or whose weight is non-finite or negative, is
dropped: a zero value with weight 0, counted in `dropped_clients`. A client participates when kept with a positive
weight.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
from typing import Optional

import numpy as np

from tests.methods_reference import inner_means as im

U32 = 2.0**-24
FLOAT32_MAX = float(np.finfo(np.float32).max)


class Ambiguous(Exception):
  """The inputs' rounding allows both a finite result and a degenerate one at some step: no single answer."""


@dataclasses.dataclass(frozen=True)
class Clients:
  values: np.ndarray  # [N, n] float64, each coordinate representable in its leaf's dtype (NaN/Inf allowed).
  weights: np.ndarray  # [N] float64: the weights as given (integers for an integer dtype; may be invalid).
  weight_dtype: np.dtype
  layout: im.Layout

  @property
  def num_clients(self) -> int:
    return len(self.weights)


@dataclasses.dataclass(frozen=True)
class Prepared:
  points: np.ndarray  # [N, n]: the kept values, zeros for dropped clients.
  weights: np.ndarray  # [N]: the float weights as the clients compute them (float32 or float64 values), 0 if dropped.
  keep: np.ndarray  # [N] bool.

  @property
  def participating(self) -> np.ndarray:
    return self.keep & (self.weights > 0)

  @property
  def dropped(self) -> int:
    return int(np.sum(~self.keep))


def prepare(clients: Clients, weight_dtype: Optional[np.dtype] = None) -> Prepared:
  """The documented client preparation; the weight in `weight_dtype` (default `float_weight_dtype`)."""
  dtype = im.float_weight_dtype(clients.weight_dtype) if weight_dtype is None else np.dtype(weight_dtype)
  values = np.asarray(clients.values, np.float64)
  with np.errstate(over='ignore', invalid='ignore'):
    weights = np.asarray(clients.weights, np.float64).astype(dtype).astype(np.float64)
    squares = np.sum(np.square(values.astype(np.float32).astype(np.float64)), axis=1)
  keep = np.all(np.isfinite(values), axis=1) & (squares <= FLOAT32_MAX) & np.isfinite(weights) & (weights >= 0)
  points = np.where(keep[:, None], values, 0.0)
  return Prepared(points, np.where(keep, weights, 0.0), keep)


def unit_weight_clients(clients: Clients) -> Clients:
  """The clients of an unweighted factory (`as_unweighted`, the Unweighted* classes): weight 1 (float32) each."""
  return Clients(clients.values, np.ones(clients.num_clients), np.dtype(np.float32), clients.layout)


def exact_fraction(x: float) -> fractions.Fraction:
  """A threshold as the decimal it is written as (0.4 is 2/5), the number the docs' inequalities mean."""
  return fractions.Fraction(repr(float(x)))


# ----------------------------------------------------------------------------------------------------------------
# GMA (GMA paper, eq. 3 and Algorithm 1; docs/methods.md, "GMA's factory and its math").


@dataclasses.dataclass(frozen=True)
class GMAExpected:
  enclosure: im.Enclosure
  mean: im.Enclosure  # The inner weighted mean Delta.
  mask: np.ndarray  # m per coordinate (exact arithmetic).
  agreement: np.ndarray  # A per coordinate (exact).
  participating: int
  dropped: int
  masked_fraction: float
  mean_agreement: float
  nonzero_clients: int  # Participating clients with a non-zero value.


def gma(clients: Clients, tau: float, mask: str, inner) -> GMAExpected:
  """Delta = the inner weighted mean of the kept values with the float weights; A_j = |(1/N) sum_n sign(Delta_n,j)|
  over the N participating clients (0 when N = 0); m_j = 1 if A_j >= tau, else A_j ('soft') or 0 ('binary');
  out = m * Delta, rounded once to the value's dtype (m computed in float32: within u32 of A, and cast to the
  value's dtype). A non-finite Delta is the documented degenerate outcome: the zero update, `nonfinite_result`."""
  layout = clients.layout
  weight_dtype = im.float_weight_dtype(clients.weight_dtype)
  prepared = prepare(clients, weight_dtype)
  mean = inner.mean(prepared.points, prepared.points, prepared.weights, prepared.weights, layout, weight_dtype)
  participating = prepared.participating
  count = int(np.sum(participating))
  sign_sum = np.sum(np.sign(prepared.points[participating]), axis=0).astype(np.int64)
  threshold = exact_fraction(tau)
  agreement, gma_mask = np.zeros(layout.n), np.zeros(layout.n)
  below = np.zeros(layout.n, bool)
  for j in range(layout.n):
    a = fractions.Fraction(abs(int(sign_sum[j])), count) if count else fractions.Fraction(0)
    agreement[j] = float(a)
    below[j] = a < threshold
    gma_mask[j] = 1.0 if not below[j] else (float(a) if mask == 'soft' else 0.0)
  nonzero = int(np.sum(participating & np.any(prepared.points != 0, axis=1)))
  # m is computed in float32 and cast to the value's dtype (float16: a rounding of its own).
  mask_roundoff = np.maximum(U32, layout.roundoff)
  enclosure = _scaled(mean, gma_mask * (1 - mask_roundoff), gma_mask * (1 + mask_roundoff), layout)
  return GMAExpected(enclosure, mean, gma_mask, agreement, count, prepared.dropped, float(np.mean(below)),
                     float(np.mean(agreement)), nonzero)


def _scaled(enclosure: im.Enclosure, scale_lo: np.ndarray, scale_hi: np.ndarray, layout: im.Layout) -> im.Enclosure:
  """scale * enclosure (scale >= 0 per coordinate), rounded once to each coordinate's dtype."""
  if enclosure.status == im.ZERO:
    return enclosure
  if enclosure.status != im.FINITE:
    return enclosure
  lo, hi = im.interval_product(scale_lo, scale_hi, enclosure.lower, enclosure.upper)
  lo, hi = im.widen(lo, hi, layout.roundoff, layout.subnormal)
  return im.Enclosure(lo, hi, im.FINITE, 0.5 * (scale_lo + scale_hi) * enclosure.center)


# ----------------------------------------------------------------------------------------------------------------
# RFA (RFA paper, Algorithms 2 and 3; docs/methods.md, "RFA's factory and the smoothed Weiszfeld algorithm").


@dataclasses.dataclass(frozen=True)
class RFAConfig:
  num_passes: int
  init: str  # 'zero' or 'mean'.
  smoothing: float  # nu.
  max_weight_ratio: float  # K.
  secure: bool
  value_bound: Optional[float]
  weight_bound: float
  exact_inner: bool  # The inner mean is FederatedMeanFactory or TFF's MeanFactory with SumFactory sums.

  @property
  def floored(self) -> bool:
    """c = max(nu, S / K) for any inner mean not known to be exact, or with secure=True (else c = nu)."""
    return self.secure or not self.exact_inner

  @property
  def num_rounds(self) -> int:
    """num_passes, plus one for a zero start's D(0) when the smoothing is floored without a value bound."""
    return self.num_passes + int(self.floored and not self.secure and self.init == 'zero')


@dataclasses.dataclass(frozen=True)
class RFAExpected:
  enclosure: im.Enclosure  # The result (in the value's dtypes).
  objectives: list  # (lo, hi) of each reported D(v_k), k = 0..R-1.
  smoothings: list  # (lo, hi) of each reported c.
  smoothing_rules: list  # Per reported c: ('constant', value) or ('floored', index of the objective it uses).
  nonfinite_passes: int
  participating: int
  dropped: int
  value_clipped: int
  weight_clipped: int
  nonzero_clients: int
  estimates: list  # The nominal iterates v_0 = 0, v_1, ..., v_R (exact arithmetic).
  boxes: list  # The (lo, hi) boxes the computed iterates lie in.


def distance_interval(points: np.ndarray, box_lo: np.ndarray, box_hi: np.ndarray, layout: im.Layout):
  """Bounds on each client's float32 `||v - w_i||` for any v in the box, as the clients compute it.

  Exact over the box: the nearest point is w_i clamped to the box, the farthest its opposite corner. Rounding: the
  casts of float64 coordinates to float32 move the difference by at most u32 (|v_j| + |w_ij|) each; the float32
  differences, squares, sums of n terms and square root add a relative (n + 4) u32 (n / 2 + 3 doubled); squares below
  the normal range lose at most 2**-150 each, so the root moves by at most sqrt(n) 2**-75 (2**-74 used).
  """
  nearest = np.clip(points, box_lo, box_hi)
  d_min = np.linalg.norm(points - nearest, axis=1)
  d_max = np.linalg.norm(np.maximum(np.abs(points - box_lo), np.abs(box_hi - points)), axis=1)
  wide = np.array([np.dtype(d) == np.float64 for d in layout.coordinate_dtypes])
  magnitude = np.maximum(np.abs(box_lo), np.abs(box_hi))
  cast = U32 * np.linalg.norm(np.where(wide, magnitude + np.abs(points), 0.0), axis=1)
  relative = (layout.n + 4) * U32
  underflow = math.sqrt(layout.n) * 2.0**-74
  lo = np.maximum(0.0, (d_min - cast) * (1 - relative) - underflow)
  hi = (d_max + cast) * (1 + relative) + underflow
  return lo, hi


def rfa(clients: Clients, config: RFAConfig, inner) -> RFAExpected:
  """Smoothed Weiszfeld with a budget of `num_passes` inner means, as an interval (box) iteration.

  The documented rounds: client i sends b_i = a_i c / max(c, d_i) (d_i = ||v - w_i|| over the whole flattened
  update, computed in float32 from the broadcast estimate) to the inner mean with its point w_i; c = nu, or, when
  floored, c = max(nu, S / K) with S = D(v_{k-2}) for pass k >= 2 (the objective D(v) = sum a_i ||v - w_i|| / sum
  a_i measured one round earlier; pass 2 uses D(0)), and for a zero start's first pass S = value_bound sqrt(n)
  (secure) or S = D(0) (measured in a round of its own). init='mean': pass 1 is the inner mean with the a_i. A
  non-finite pass result is replaced by the previous estimate (v_0 = 0 for pass 1) and counted; float16 values are
  computed in float32 and the result cast back. With secure=True values are clipped to [-B, B] and weights to
  [0, W] first, and the objective is a `SecureWeightedMeanFactory` with the distance bound 2 B sqrt(n) (the
  0.1% margin the code adds, 2.002, is used for the quantum: a bound that only grows with it).

  Propagation: the computed estimate v'_k lies in a box [lo_k, hi_k] (v'_0 = 0 exactly). Each client's computed
  distance lies in `distance_interval`; the smoothing c' in an interval from the objective's (max and float32
  division are monotone); the weight b'_i = fl(fl(a'_i c') / max(c', d'_i)) in [a'_i c_lo / max(c_lo, d_hi)
  (1 - u)^2, a'_i c_hi / max(c_hi, d_lo) (1 + u)^2] (increasing in c', decreasing in d'); and the inner model's
  enclosure over those weights is the next box. Sound by construction, and as tight as the Weiszfeld map's
  sensitivity to its input allows (no Lipschitz constant is assumed: the box method computes the exact range of a
  weighted mean over a box of weights, `inner_means.box_mean_range`). `estimates` holds the nominal iterates (exact
  arithmetic, exact weights a_i), which lie in the boxes up to the float32 cast of the weights.
  """
  layout = clients.layout
  compute = layout.compute_layout()
  n = layout.n
  prepared = prepare(clients, np.float32)  # RFA casts every weight to float32.
  points = compute.round(prepared.points)  # float16 -> float32 is exact.
  a32 = prepared.weights
  a_nominal = np.where(prepared.keep, np.asarray(clients.weights, np.float64), 0.0)
  value_clipped = weight_clipped = 0
  if config.secure:
    bound = compute.round(np.full(n, config.value_bound))
    clipped = np.clip(points, -bound, bound)
    value_clipped = int(np.sum(np.any(clipped != points, axis=1)))
    points = clipped
    w_bound = float(np.float32(config.weight_bound))
    weight_clipped = int(np.sum(a32 > w_bound))
    a32 = np.minimum(a32, w_bound)
    a_nominal = np.minimum(a_nominal, config.weight_bound)
  participating = prepared.keep & (a32 > 0)
  nonzero = int(np.sum(participating & np.any(points != 0, axis=1)))

  objective_model = (im.model_for('secure_weighted_mean', 2.002 * config.value_bound * math.sqrt(n),
                                  config.weight_bound) if config.secure else im.model_for('federated_mean'))
  scalar = im.Layout(((),), (np.dtype(np.float32),))
  nu32 = float(np.float32(config.smoothing))
  k32 = float(np.float32(config.max_weight_ratio))

  objectives, objectives_nominal = [], []

  def measure(box_lo, box_hi, nominal):
    d_lo, d_hi = distance_interval(points, box_lo, box_hi, compute)
    enclosure = objective_model.mean(d_lo[:, None], d_hi[:, None], a32, a32, scalar, np.float32)
    if enclosure.status == im.AMBIGUOUS:
      raise Ambiguous('objective')
    # A zero total weight gives D = 0 (FederatedMeanFactory, or the secure mean's divide_no_nan).
    objectives.append((float(enclosure.lower[0]), float(enclosure.upper[0])))
    distances = np.linalg.norm(points - nominal, axis=1)
    objectives_nominal.append(float(a_nominal @ distances / a_nominal.sum()) if a_nominal.sum() > 0 else 0.0)
    return d_lo, d_hi, distances

  smoothings, rules = [], []

  def floored_smoothing(scale_index):
    s_lo, s_hi = objectives[scale_index]
    c_lo = max(nu32, s_lo / k32 * (1 - U32))
    c_hi = max(nu32, s_hi / k32 * (1 + U32))
    nominal = max(config.smoothing, objectives_nominal[scale_index] / config.max_weight_ratio)
    rules.append(('floored', scale_index))
    return c_lo, c_hi, nominal

  def constant_smoothing(value):
    rules.append(('constant', float(np.float32(value))))
    return float(np.float32(value)) * (1 - U32), float(np.float32(value)) * (1 + U32), value

  nonfinite = 0
  estimates = [np.zeros(n)]
  boxes = [(np.zeros(n), np.zeros(n))]

  def run_pass(b_lo, b_hi, b_nominal, unit=1.0):
    nonlocal nonfinite
    if unit == 1.0:
      enclosure = inner.mean(points, points, b_lo, b_hi, compute, np.float32, points, b_nominal)
    else:
      enclosure = inner.mean(points, points, b_lo, b_hi, compute, np.float32, points, b_nominal, weight_unit=unit)
    if enclosure.status == im.AMBIGUOUS:
      raise Ambiguous(f'pass {len(estimates)}')
    if enclosure.status == im.NONFINITE:  # Replaced by the previous estimate (v_0 = 0 for pass 1), counted.
      nonfinite += 1
      boxes.append(boxes[-1])
      estimates.append(estimates[-1])
    else:
      boxes.append((enclosure.lower, enclosure.upper))
      estimates.append(enclosure.center)

  def reweighted_pass(d_lo, d_hi, distances, c_lo, c_hi, c_nominal):
    smoothings.append((c_lo, c_hi))
    if getattr(inner, 'homogeneous', False):
      # The common factor c' of every b'_i = a_i c' / max(c', d'_i) cancels in a mean that is invariant to scaling
      # the weights: the box is that of a_i / max(c', d'_i), which depends on c' only for the clients within c'.
      b_lo = a32 / np.maximum(c_hi, d_hi) * (1 - U32)**2
      b_hi = a32 / np.maximum(c_lo, d_lo) * (1 + U32)**2
      run_pass(b_lo, b_hi, a_nominal / np.maximum(c_nominal, distances), unit=c_lo)
      return
    b_lo = a32 * c_lo / np.maximum(c_lo, d_hi) * (1 - U32)**2
    b_hi = a32 * c_hi / np.maximum(c_hi, d_lo) * (1 + U32)**2
    b_nominal = a_nominal * c_nominal / np.maximum(c_nominal, distances)
    run_pass(b_lo, b_hi, b_nominal)

  # Round 1: distances to v_0 = 0 give D(0) and, from the zero start, the first reweighting.
  d_lo, d_hi, distances = measure(*boxes[0], estimates[0])
  if config.init == 'zero':
    if not config.floored:
      c = constant_smoothing(config.smoothing)
    elif config.secure:
      c = constant_smoothing(max(config.smoothing, config.value_bound * math.sqrt(n) / config.max_weight_ratio))
    else:
      c = floored_smoothing(0)
    reweighted_pass(d_lo, d_hi, distances, *c)
  else:
    run_pass(a32, a32, a_nominal)
  # Rounds k = 2..R: distances to v_{k-1}, D(v_{k-1}), the smoothing from D(v_{k-2}), pass k.
  for _ in range(config.num_passes - 1):
    scale_index = len(objectives) - 1
    d_lo, d_hi, distances = measure(*boxes[-1], estimates[-1])
    c = floored_smoothing(scale_index) if config.floored else constant_smoothing(config.smoothing)
    reweighted_pass(d_lo, d_hi, distances, *c)

  box_lo, box_hi = boxes[-1]
  result_lo, result_hi = layout.round(box_lo), layout.round(box_hi)  # The cast back is monotone.
  status = im.ZERO if not np.any(result_lo) and not np.any(result_hi) else im.FINITE
  enclosure = im.Enclosure(result_lo, result_hi, status, estimates[-1])
  return RFAExpected(enclosure, objectives, smoothings, rules, nonfinite, int(np.sum(participating)),
                     prepared.dropped, value_clipped, weight_clipped, nonzero, estimates, boxes)


# ----------------------------------------------------------------------------------------------------------------
# Elastic aggregation (Elastic Aggregation paper, Algorithm 1; docs/methods.md, "Elastic aggregation").


@dataclasses.dataclass(frozen=True)
class ElasticExpected:
  enclosure: im.Enclosure
  zeta_lo: np.ndarray
  zeta_hi: np.ndarray
  dropped: int
  nonzero_clients: int  # Participating clients with a non-zero update.


def elastic(clients: Clients, part: im.Layout, tau: float, update_mean, sensitivity_mean) -> ElasticExpected:
  """Values [update, sensitivity] (`part` the layout of one part); Omega and Delta the two weighted means; per tensor
  zeta = 1 + tau - Omega / max(Omega) (zeta = 1 where max(Omega) <= 0); out = zeta * Delta.

  Rounding: the ratio Omega / max rounds once, 1 + tau - ratio twice (tau's float32 constant, the additions), and the
  product once: zeta within 4 u of its exact value at the computed means, the product within u more.
  """
  n = part.n
  weight_dtype = im.float_weight_dtype(clients.weight_dtype)
  prepared = prepare(clients, weight_dtype)
  update, sensitivity = prepared.points[:, :n], prepared.points[:, n:]
  nonzero = int(np.sum(prepared.participating & np.any(update != 0, axis=1)))
  delta = update_mean.mean(update, update, prepared.weights, prepared.weights, part, weight_dtype)
  omega = sensitivity_mean.mean(sensitivity, sensitivity, prepared.weights, prepared.weights, part, weight_dtype)
  if delta.status == im.AMBIGUOUS or omega.status == im.AMBIGUOUS:
    raise Ambiguous('elastic mean')
  if delta.status == im.NONFINITE or omega.status == im.NONFINITE:
    return ElasticExpected(im.Enclosure.nonfinite(n), np.full(n, -np.inf), np.full(n, np.inf), prepared.dropped,
                           nonzero)
  u = part.roundoff
  zeta_lo, zeta_hi, zeta_center = np.ones(n), np.ones(n), np.ones(n)
  for sl in part.slices:
    o_lo, o_hi = omega.lower[sl], omega.upper[sl]
    top_lo, top_hi = float(np.max(o_lo)), float(np.max(o_hi))
    if top_hi <= 0:
      continue  # zeta = 1 exactly.
    if top_lo <= 0:  # The computed max may be <= 0 (zeta = 1) or positive and tiny: no useful bound.
      zeta_lo[sl], zeta_hi[sl] = -np.inf, np.inf
      continue
    ratio_lo = np.where(o_lo < 0, o_lo / top_lo, o_lo / top_hi)
    ratio_hi = np.minimum(np.where(o_hi > 0, o_hi / top_lo, o_hi / top_hi), 1.0)  # Omega_j <= max(Omega).
    z_lo, z_hi = 1 + tau - ratio_hi, 1 + tau - ratio_lo
    z_lo, z_hi = im.widen(z_lo, z_hi, 0.0, (4 + 3 * tau) * u[sl])  # Absolute: zeta may be 0 (tau = 0).
    zeta_lo[sl], zeta_hi[sl] = z_lo, z_hi
    center_top = float(np.max(omega.center[sl]))
    zeta_center[sl] = 1 + tau - omega.center[sl] / center_top if center_top > 0 else 1.0
  if delta.status == im.ZERO:
    return ElasticExpected(im.Enclosure.zero(n), zeta_lo, zeta_hi, prepared.dropped, nonzero)
  lo, hi = im.interval_product(zeta_lo, zeta_hi, delta.lower, delta.upper)
  lo, hi = im.widen(lo, hi, u, part.subnormal)
  lo, hi = np.nan_to_num(lo, nan=-np.inf), np.nan_to_num(hi, nan=np.inf)  # inf * 0.
  return ElasticExpected(im.Enclosure(lo, hi, im.FINITE, zeta_center * delta.center), zeta_lo, zeta_hi,
                         prepared.dropped, nonzero)


# ----------------------------------------------------------------------------------------------------------------
# FedGMA (Gradient-Masked Federated Optimization, Algorithm 1; docs/methods.md, "FedGMA").


@dataclasses.dataclass(frozen=True)
class FedGMAExpected:
  enclosure: im.Enclosure
  update: im.Enclosure
  gradient: GMAExpected
  nonzero_clients: int  # Participating clients (kept, weight > 0) whose value (update or gradient) is non-zero.


def fedgma(clients: Clients, part: im.Layout, server_step_size: float, mask_threshold: float, update_mean,
           gradient_mean) -> FedGMAExpected:
  """Values [update, gradient]; out = Delta + eta_s * (AND-mask * weighted mean gradient).

  Delta: the update's mean by `update_mean`, to which a client invalid in its update or gradient (or weight) comes
  as a zero update of weight 0, the weights cast to float as GMA's and RFA's clients do; the masked gradient: GMA
  (binary, threshold 2p - 1: at least a fraction p agree) with `gradient_mean` on the gradients and weights as given
  (GMA drops invalid clients itself). eta_s is a constant of the value's dtype; the product and the sum round once
  each. A non-finite step is the documented degenerate outcome (the zero update, `nonfinite_result`).
  """
  n = part.n
  weight_dtype = im.float_weight_dtype(clients.weight_dtype)
  prepared = prepare(clients, weight_dtype)
  update = update_mean.mean(prepared.points[:, :n], prepared.points[:, :n], prepared.weights, prepared.weights, part,
                            weight_dtype)
  gradient_clients = Clients(clients.values[:, n:], clients.weights, clients.weight_dtype, part)
  threshold = fractions.Fraction(2) * exact_fraction(mask_threshold) - 1
  gradient = gma(gradient_clients, float(max(threshold, 0)), 'binary', gradient_mean)
  nonzero = int(np.sum(prepared.participating & np.any(prepared.points != 0, axis=1)))
  if im.AMBIGUOUS in (update.status, gradient.enclosure.status):
    raise Ambiguous('fedgma mean')
  if im.NONFINITE in (update.status, gradient.enclosure.status):
    return FedGMAExpected(im.Enclosure.nonfinite(n), update, gradient, nonzero)
  u = part.roundoff
  eta = part.round(np.full(n, server_step_size))
  g = gradient.enclosure
  if g.status == im.ZERO:
    g_lo = g_hi = np.zeros(n)
  else:
    g_lo, g_hi = im.interval_product(eta, eta, g.lower, g.upper)
    g_lo, g_hi = im.widen(g_lo, g_hi, u, part.subnormal)
  d_lo, d_hi = (np.zeros(n), np.zeros(n)) if update.status == im.ZERO else (update.lower, update.upper)
  if update.status == im.ZERO and g.status == im.ZERO:
    return FedGMAExpected(im.Enclosure.zero(n), update, gradient, nonzero)
  lo, hi = im.widen(d_lo + g_lo, d_hi + g_hi, u, part.subnormal)
  center = (0 if update.status == im.ZERO else update.center) + server_step_size * (
      0 if g.status == im.ZERO else g.center)
  return FedGMAExpected(im.Enclosure(lo, hi, im.FINITE, np.broadcast_to(center, (n,)).astype(np.float64)), update,
                        gradient, nonzero)


# ----------------------------------------------------------------------------------------------------------------
# The weighted means on their own.


def weighted_mean(clients: Clients, model) -> tuple[im.Enclosure, Prepared]:
  """`FederatedMeanFactory` / `SecureWeightedMeanFactory` as factories: the documented client preparation, then the
  model (the preparation drops invalid clients: docs/methods.md, "Non-finite input", "used by every factory: the
  means, ...")."""
  prepared = prepare(clients)
  weight_dtype = im.float_weight_dtype(clients.weight_dtype)
  enclosure = model.mean(prepared.points, prepared.points, prepared.weights, prepared.weights, clients.layout,
                         weight_dtype)
  if enclosure.status == im.AMBIGUOUS:
    raise Ambiguous('mean')
  return enclosure, prepared
