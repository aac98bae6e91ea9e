"""Client values and weights before they reach an aggregate: type checks, dropping of invalid clients, clipping.

Every factory of this library prepares its clients the same way with these helpers (none of them aggregates):
weights of any float or integer dtype are cast to float first, so the bounds logic is the same for all; a client
with a non-finite value or weight becomes a zero value of weight 0, flagged so that it can be counted securely.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

# ----------------------------------------------------------------------------------------------------------------
# Types.


def tensor_types(value_type) -> list:
  """The `tff.TensorType`s of a (structure of) tensor type(s), flattened in TFF's order."""
  return tff.structure.flatten(value_type) if isinstance(value_type, tff.StructType) else [value_type]


def is_float_dtype(dtype) -> bool:
  """A NumPy float dtype, or bfloat16 (an `ml_dtypes` type that NumPy does not count as `np.floating`)."""
  return np.issubdtype(dtype, np.floating) or np.dtype(dtype) == np.dtype(tf.bfloat16.as_numpy_dtype)


def compute_dtype(dtype) -> np.dtype:
  """float32 for a float narrower than float32 (float16, bfloat16), else `dtype`: what weighted sums run in."""
  dtype = np.dtype(tf.as_dtype(dtype).as_numpy_dtype)
  return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


def compute_type(value_type):
  """`value_type` with every float16 and bfloat16 tensor as float32 (`compute_dtype`)."""
  return tff.to_type(tff.types.structure_from_tensor_type_tree(
      lambda t: tff.TensorType(compute_dtype(t.dtype), t.shape), value_type))


def to_compute_dtypes(value):
  """`value` with every float16 and bfloat16 tensor cast to float32 (`compute_dtype`), the others as they are."""
  return tf.nest.map_structure(lambda x: tf.cast(x, compute_dtype(x.dtype)), value)


def cast_leaves(value, dtypes):
  """`value`'s tensors, in `tf.nest` order, cast to `dtypes` (e.g. a result back to the value type's dtypes)."""
  leaves = [tf.cast(x, dtype) for x, dtype in zip(tf.nest.flatten(value), dtypes)]
  return tf.nest.pack_sequence_as(value, leaves)


def check_float_structure(value_type, name: str = 'value_type') -> None:
  """Raises TypeError unless `value_type` is a non-federated tensor or structure of float tensors."""
  if isinstance(value_type, tff.FederatedType) or not isinstance(value_type, (tff.TensorType, tff.StructType)):
    raise TypeError(f'{name} must be an unplaced tff.TensorType or tff.StructType, got {value_type}')
  leaves = tensor_types(value_type)
  if not leaves:
    raise TypeError(f'{name} must hold at least one tensor, got {value_type}')
  for leaf in leaves:
    if not isinstance(leaf, tff.TensorType) or not is_float_dtype(leaf.dtype):
      raise TypeError(f'every tensor of {name} must be of a float dtype, got {value_type}')
    if leaf.shape is None or any(d is None for d in leaf.shape):
      raise TypeError(f'every tensor of {name} must have a fully defined shape, got {value_type}')


def check_weight_type(weight_type, name: str = 'weight_type') -> None:
  """Raises TypeError unless `weight_type` is an unplaced scalar of a real number dtype (float or integer).

  The weight dtypes TFF's `tff.aggregators.MeanFactory` accepts and runs, less bool (which TFF refuses too) and
  complex (a weight must be comparable with 0). TFF also accepts a non-scalar weight (multiplied elementwise
  into the value); a client weight here is one number per client.
  """
  if not (isinstance(weight_type, tff.TensorType) and weight_type.shape is not None
          and len(weight_type.shape) == 0  # pylint: disable=g-explicit-length-test
          and (np.issubdtype(weight_type.dtype, np.floating) or np.issubdtype(weight_type.dtype, np.integer))):
    raise TypeError(f'{name} must be an unplaced scalar tff.TensorType of a float or integer dtype, '
                    f'got {weight_type}')


def float_weight_dtype(weight_dtype) -> np.dtype:
  """The dtype client weights are computed in: float64 for float64 weights, float32 for every other dtype.

  Integer weights (example counts) are cast to float inside the client-side computation, before any check,
  clipping or normalization (a `weight_bound` of 1e4 does not fit an int8 or a float16 weight).
  """
  return np.dtype(np.float64) if np.dtype(weight_dtype) == np.float64 else np.dtype(np.float32)


def float_weight_type(weight_type) -> tff.TensorType:
  """The scalar `tff.TensorType` of `float_weight_dtype(weight_type.dtype)`: what inner weighted processes get."""
  return tff.TensorType(float_weight_dtype(weight_type.dtype))


def num_elements(value_type) -> int:
  """Total number of scalars in a (structure of) tensor type(s)."""
  return int(sum(math.prod(leaf.shape) for leaf in tensor_types(value_type)))


# ----------------------------------------------------------------------------------------------------------------
# Plain TF (client side).


def all_finite(value) -> tf.Tensor:
  """Scalar bool: every element of every tensor of the structure `value` is finite."""
  leaves = tf.nest.flatten(value)
  if not leaves:
    return tf.constant(True)
  return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(x)) for x in leaves]))


def squared_norm_is_finite(value) -> tf.Tensor:
  """Scalar bool: the squared Euclidean norm of all elements of `value`, summed in float32, is finite."""
  leaves = tf.nest.flatten(value)
  if not leaves:
    return tf.constant(True)
  squares = tf.add_n([tf.reduce_sum(tf.square(tf.cast(x, tf.float32))) for x in leaves])
  return tf.math.is_finite(squares)


def float_weight(weight) -> tf.Tensor:
  """A client weight of any accepted dtype (`check_weight_type`) as a float tensor of `float_weight_dtype`."""
  weight = tf.convert_to_tensor(weight)
  return tf.cast(weight, float_weight_dtype(weight.dtype.as_numpy_dtype))


def drop_invalid_clients(value, weight):
  """Zeroes a client that must not reach the server; returns `(value, weight, keep)`.

  The weight is first cast to `float_weight_dtype` (integer weights become float32), and the returned weight
  has that dtype. A client is dropped when any element of `value` is NaN/Inf, when the squared Euclidean norm of
  its whole update overflows float32 (coordinates of about 1e19 and more: such an update cannot be averaged or
  measured in float32 without overflowing), or when its `weight` is non-finite or negative. A dropped client returns
  zeros of the value's structure and weight 0 (so that `0 * value` cannot produce NaN downstream). `keep` is an int32
  scalar, 1 for a kept client, 0 for a dropped one.
  """
  weight = float_weight(weight)
  weight_ok = tf.logical_and(tf.math.is_finite(weight), weight >= 0)
  keep = tf.logical_and(tf.logical_and(all_finite(value), squared_norm_is_finite(value)), weight_ok)
  clean_value = tf.nest.map_structure(lambda x: tf.where(keep, x, tf.zeros_like(x)), value)
  clean_weight = tf.where(keep, weight, tf.zeros_like(weight))
  return clean_value, clean_weight, tf.cast(keep, tf.int32)


def clip_to_bounds(value, weight, value_bound: float, weight_bound: float):
  """Clips `value` to `[-value_bound, value_bound]` and `weight` to `[0, weight_bound]`.

  Returns `(value, weight, value_clipped, weight_clipped)`, the last two int32 0/1 flags saying whether any
  coordinate of the value, resp. the weight, was changed. The bounds become constants of each tensor's dtype
  directly (`tf.cast` of a Python float would round it to float32 first, and clip a float64 value at the bound).
  """
  clipped = tf.nest.map_structure(
      lambda x: tf.clip_by_value(x, tf.constant(-value_bound, x.dtype), tf.constant(value_bound, x.dtype)), value)
  changed = [tf.reduce_any(tf.not_equal(x, c)) for x, c in zip(tf.nest.flatten(value), tf.nest.flatten(clipped))]
  value_clipped = tf.reduce_any(tf.stack(changed)) if changed else tf.constant(False)
  clipped_weight = tf.clip_by_value(weight, tf.zeros_like(weight), tf.constant(weight_bound, weight.dtype))
  weight_clipped = tf.not_equal(weight, clipped_weight)
  return clipped, clipped_weight, tf.cast(value_clipped, tf.int32), tf.cast(weight_clipped, tf.int32)
