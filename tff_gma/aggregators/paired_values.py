"""Value types of factories whose clients send two structures of the same shape side by side.

`ElasticFactory` (`update`, `sensitivity`) and `FedGMAFactory` (`update`, `gradient`) aggregate client values
`collections.OrderedDict(<first>=<structure>, <second>=<structure of the same shape>)`, each part with its own
inner process. `split_paired_value_type` checks such a value type and returns the types of its two parts.
"""

from __future__ import annotations

import numpy as np
import tensorflow_federated as tff

from tff_gma.aggregators import client_values


def _shapes_only(part_type):
  """`part_type` with every tensor made float32: two such types are equivalent iff structure and shapes agree."""
  return tff.to_type(tff.types.structure_from_tensor_type_tree(
      lambda t: tff.TensorType(np.float32, t.shape), part_type))


def split_paired_value_type(value_type, first: str, second: str, *, same_dtypes: bool = False):
  """(type of `first`, type of `second`) of a value type `<first=A, second=B>`, after checking it.

  Args:
    value_type: the factory's `value_type`.
    first, second: the two field names, in this order.
    same_dtypes: also require the same dtypes (B equivalent to A), for a result that adds the two parts.

  Returns:
    `(value_type[first], value_type[second])`.

  Raises:
    TypeError: unless `value_type` is an unplaced struct with exactly the fields `first`, `second` (in this order)
      whose parts are float structures (`client_values.check_float_structure`) of the same structure and shapes
      (and dtypes, with `same_dtypes`).
  """
  if not isinstance(value_type, tff.StructType) or isinstance(value_type, tff.FederatedType):
    raise TypeError(f'value_type must be a struct with fields {first!r} and {second!r}, got {value_type}')
  names = [name for name, _ in tff.structure.iter_elements(value_type)]
  if names != [first, second]:
    raise TypeError(f'value_type must have exactly the fields ({first!r}, {second!r}) in this order, got {names} '
                    f'in {value_type}')
  first_type, second_type = value_type[first], value_type[second]
  client_values.check_float_structure(first_type, f'value_type.{first}')
  client_values.check_float_structure(second_type, f'value_type.{second}')
  if not _shapes_only(first_type).is_equivalent_to(_shapes_only(second_type)):
    raise TypeError(f'value_type.{first} and value_type.{second} must have the same structure and shapes, got '
                    f'{first_type} and {second_type}')
  if same_dtypes and not first_type.is_equivalent_to(second_type):
    raise TypeError(f'value_type.{first} and value_type.{second} must have the same dtypes, got {first_type} and '
                    f'{second_type}')
  return first_type, second_type
