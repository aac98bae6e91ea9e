"""Aggregators beyond plain averaging, as `tff.aggregators` factories built only from mean and secure-sum intrinsics.

GMA (`GradientMaskedFactory`), RFA (`GeometricMedianFactory`), Centered Clipping (`CenteredClippingFactory`),
`ElasticFactory`, `FedGMAFactory` and the weighted means they are built from; the non-private robust baselines stay in
`robust_baselines`, and bucketing around them in `bucketing`. They use secure sums, so
they need a context that runs them (`tff_gma.runtime.set_simulation_context()`).
"""

from tff_gma.aggregators.centered_clipping import CenteredClippingFactory
from tff_gma.aggregators.centered_clipping import UnweightedCenteredClippingFactory
from tff_gma.aggregators.elastic import ElasticFactory
from tff_gma.aggregators.fedgma import FedGMAFactory
from tff_gma.aggregators.geometric_median import GeometricMedianFactory
from tff_gma.aggregators.geometric_median import UnweightedGeometricMedianFactory
from tff_gma.aggregators.gradient_masked import GradientMaskedFactory
from tff_gma.aggregators.gradient_masked import UnweightedGradientMaskedFactory
from tff_gma.aggregators.mean import as_unweighted
from tff_gma.aggregators.mean import FederatedMeanFactory
from tff_gma.aggregators.secure_mean import SecureWeightedMeanFactory
from tff_gma.aggregators.staged import create_staged
from tff_gma.aggregators.staged import from_process
from tff_gma.aggregators.staged import StagedAggregationProcess

__all__ = [
    'CenteredClippingFactory',
    'ElasticFactory',
    'FedGMAFactory',
    'FederatedMeanFactory',
    'GeometricMedianFactory',
    'GradientMaskedFactory',
    'SecureWeightedMeanFactory',
    'StagedAggregationProcess',
    'UnweightedCenteredClippingFactory',
    'UnweightedGeometricMedianFactory',
    'UnweightedGradientMaskedFactory',
    'as_unweighted',
    'create_staged',
    'from_process',
]
