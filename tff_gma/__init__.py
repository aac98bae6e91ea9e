"""tff-gma: aggregation beyond plain averaging for TensorFlow Federated.

Subpackages are imported lazily by their users (`tff_gma.aggregators`, `tff_gma.data`, ...) so that
`import tff_gma` itself stays cheap and does not import TensorFlow.
"""

__version__ = '0.1.0'
