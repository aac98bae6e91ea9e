"""Which intrinsics may carry client data to the server: the intrinsic families and the `AuditPolicy` over them.

Kept apart from the walk so that a policy (what is allowed) can be read and built without TensorFlow Federated's
internals; `tff_gma.audit.static` checks every flow it finds against one. By default only the means and the secure
sums may carry client data to the server.
"""

from __future__ import annotations

import dataclasses

# Intrinsics through which client data may reach the server under the default policy.
SECURE_SUM_INTRINSICS = frozenset({
    'federated_secure_sum',
    'federated_secure_sum_bitwidth',
    'federated_secure_modular_sum',
})
MEAN_INTRINSICS = frozenset({'federated_mean', 'federated_weighted_mean'})
PLAIN_SUM_INTRINSICS = frozenset({'federated_sum'})
DEFAULT_ALLOWED_INTRINSICS = MEAN_INTRINSICS | SECURE_SUM_INTRINSICS
# `federated_select` / `federated_secure_select` send values to the clients, but picked by client-held keys: the
# keys are client data the server (or, for the secure variant, the selection protocol) gets to act on.
KEYED_SELECT_INTRINSICS = frozenset({'federated_select', 'federated_secure_select'})

@dataclasses.dataclass(frozen=True)
class AuditPolicy:
  """Which intrinsics may carry client data to the server.

  Attributes:
    allowed_intrinsics: intrinsic URIs allowed to move client data to the server. Defaults to the means and the
      secure-sum family.
    allow_plain_sum: also allow `federated_sum` (a plain, non-secure sum of client values).
  """

  allowed_intrinsics: frozenset[str] = DEFAULT_ALLOWED_INTRINSICS
  allow_plain_sum: bool = False

  def __post_init__(self):
    if isinstance(self.allowed_intrinsics, str):
      raise ValueError('allowed_intrinsics must be a collection of intrinsic URIs, not a single string; got '
                       f'{self.allowed_intrinsics!r}')
    object.__setattr__(self, 'allowed_intrinsics', frozenset(self.allowed_intrinsics))

  @property
  def allowed(self) -> frozenset[str]:
    """Every intrinsic URI this policy allows to carry client data to the server."""
    return self.allowed_intrinsics | (PLAIN_SUM_INTRINSICS if self.allow_plain_sum else frozenset())

  def allows(self, intrinsic: str) -> bool:
    return intrinsic in self.allowed

  def describe(self) -> str:
    return 'client data may reach the server only through: ' + ', '.join(f'`{u}`' for u in sorted(self.allowed))


DEFAULT_POLICY = AuditPolicy()
