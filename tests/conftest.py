"""Test-session settings.

The tests check values, not speed, and most of their time on CPU goes to XLA
compiling many small programs; the backend's optimisation level 0 cuts that
about fivefold. Set XLA_FLAGS yourself to override.
"""

import os

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_backend_optimization_level=0").strip()
