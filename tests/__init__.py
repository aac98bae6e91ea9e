"""tff-gma's tests: `tests/tff_gma/` mirrors the library (one test module per module), `tests/training/` the harness."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # The checkout's root.
