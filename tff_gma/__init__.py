"""tff-gma: aggregation beyond plain averaging for TensorFlow Federated.

Subpackages are imported lazily by their users (`tff_gma.aggregators`, `tff_gma.data`, ...) so that
`import tff_gma` itself stays cheap and does not import TensorFlow.
"""

__version__ = '0.1.0'

import logging as _logging


class _DropUnusedAssertionNoise(_logging.Filter):
  """Drops TF's "Object was never used" report, which TFF's quantized secure sum triggers on every trace.

  Its bound assertions are built but not used in graph mode; TF then logs a long ERROR with a stack trace for
  each, although nothing is wrong. Only that report is dropped; other TF messages pass.
  """

  def filter(self, record: _logging.LogRecord) -> bool:
    return 'Object was never used' not in record.getMessage()


_logging.getLogger('tensorflow').addFilter(_DropUnusedAssertionNoise())
