"""Aggregators beyond plain averaging, as `tff.aggregators` factories built only from mean and secure-sum intrinsics.

* `GradientMaskedFactory` / `UnweightedGradientMaskedFactory`: Gradient Masked Averaging (GMA): the weighted
  mean masked by the clients' sign agreement, the agreement computed from secure-summed sign codes.
* `GeometricMedianFactory` / `UnweightedGeometricMedianFactory`: Robust Federated Aggregation (RFA): the smoothed
  geometric median by a few secure averages (smoothed Weiszfeld; one-step RFA with `one_step=True`).
* `ElasticFactory`: Elastic aggregation: the weighted mean of client updates scaled per coordinate by the
  clients' parameter sensitivity (values `OrderedDict(update=..., sensitivity=...)`; see `tff_gma.learning`).
* `FedGMAFactory`: FedGMA's server step: the weighted mean update plus a step along the AND-masked (GMA, binary
  mask) weighted mean of the clients' gradients (values `OrderedDict(update=..., gradient=...)`; client work in
  `tff_gma.learning.build_fedgma`).
* `FederatedMeanFactory`, `SecureWeightedMeanFactory`: the weighted means they are built from (`federated_mean`,
  or TFF's quantized secure sum), usable on their own; `as_unweighted` turns a weighted factory into an unweighted one.

Example::

    aggregator = tff_gma.aggregators.GradientMaskedFactory(tau=0.4)      # or GeometricMedianFactory()
    process = tff.learning.algorithms.build_weighted_fed_avg(model_fn, client_optimizer_fn,
                                                             model_aggregator=aggregator)

Weights: every weighted factory accepts a scalar `weight_type` of any float or integer dtype, as TFF's
`MeanFactory` does. The clients cast integer weights (e.g. example counts) to float32 before anything else
(`client_values.float_weight_dtype`), so an integer weight gives the result of the same weight as a float32.

The non-private baselines of the robustness study (coordinate-wise median, trimmed mean, multi-Krum) collect
every client's update at the server; they are not exported here (see `tff_gma.aggregators.robust_baselines`).

Differential privacy: GMA and RFA have none, and their unweighted factories refuse (at `create`, one line) to be
`tff.aggregators.DifferentiallyPrivateFactory`'s `record_aggregation_factory` or `MeanFactory`'s sum factories,
slots TFF treats as sums, where they would return a wrong result silently (`composition`).

The processes use `tff.federated_secure_sum` (GMA's sign sums, the client counts), so they need an execution
context that supports the secure intrinsics, such as `tff_gma.runtime.set_simulation_context()`.
"""

from tff_gma.aggregators.elastic import ElasticFactory
from tff_gma.aggregators.fedgma import FedGMAFactory
from tff_gma.aggregators.geometric_median import GeometricMedianFactory
from tff_gma.aggregators.geometric_median import UnweightedGeometricMedianFactory
from tff_gma.aggregators.gradient_masked import GradientMaskedFactory
from tff_gma.aggregators.gradient_masked import UnweightedGradientMaskedFactory
from tff_gma.aggregators.mean import as_unweighted
from tff_gma.aggregators.mean import FederatedMeanFactory
from tff_gma.aggregators.secure_mean import SecureWeightedMeanFactory

__all__ = [
    'ElasticFactory',
    'FedGMAFactory',
    'FederatedMeanFactory',
    'GeometricMedianFactory',
    'GradientMaskedFactory',
    'SecureWeightedMeanFactory',
    'UnweightedGeometricMedianFactory',
    'UnweightedGradientMaskedFactory',
    'as_unweighted',
]
