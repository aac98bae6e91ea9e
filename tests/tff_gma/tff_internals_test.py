"""Pins every TFF internal that tff_gma/tff_internals.py names: a TFF upgrade that moves one fails here, by name."""

from absl.testing import absltest


# ---------------------------------------------------------------------------------------------------------------
# Execution contexts and the worker.


# ---------------------------------------------------------------------------------------------------------------
# The audit.


# ---------------------------------------------------------------------------------------------------------------
# Learning processes, models and data.


if __name__ == '__main__':
  absltest.main()
