"""The one place tff_gma reaches into TFF 0.87's private modules, where TFF has no public API for what it needs.

Each use is one name here, says why no public API serves, and is pinned by `tests/tff_gma/tff_internals_test.py`,
so that a TFF upgrade that moves one fails there, by name, not somewhere deep in a run. The audit's building-block
walker (`tff_gma/audit/static.py`) reads TFF's compiled form by design and is the one exception.
"""

# ---------------------------------------------------------------------------------------------------------------
# Execution contexts and the worker (tff_gma/runtime).


# ---------------------------------------------------------------------------------------------------------------
# The audit's loader and isolation (tff_gma/audit).


# ---------------------------------------------------------------------------------------------------------------
# Learning processes, models and data (tff_gma/learning, tff_gma/models.py, tff_gma/data, training/engine).
