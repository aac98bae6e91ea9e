"""tff-gma: aggregation beyond plain averaging for TensorFlow Federated.

Subpackages are imported lazily by their users (`tff_gma.aggregators`, `tff_gma.data`, ...), so `import tff_gma`
stays cheap and imports no TensorFlow. Importing it or any of its modules leaves TFF and the process as they were;
`tff_gma.runtime` installs hooks only when it starts a worker or a context.
"""

__version__ = '0.1.0'
