"""tff-gma: aggregation beyond plain averaging for TensorFlow Federated.

Subpackages are imported lazily by their users (`tff_gma.aggregators`, `tff_gma.data`, ...) so that
`import tff_gma` itself stays cheap and does not import TensorFlow.

Importing `tff_gma` or any of its modules leaves TensorFlow Federated and the process as they were: no import
hook, TFF's default context untouched, no exit hook, signal handler or logging filter. Those are installed only
where this library's own code runs: `tff_gma.runtime` when it starts a worker or installs a context
(docs/runtime.md#contexts).
"""

__version__ = '0.1.0'
