"""Test-session settings.

The tests check values, not speed, and most of their time on CPU goes to XLA
compiling many small programs; the backend's optimisation level 0 cuts that
about fivefold. Set XLA_FLAGS yourself to override.
"""

import os

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_backend_optimization_level=0").strip()

# float32 matrix products in float32. On GPUs XLA (and Triton inside the Pallas
# kernels) run float32 dots as TF32 by default, ~1e-3 off the float32 reference;
# the tests check the algorithms at float32 tolerances, so they ask for float32
# (the kernels' dots follow this setting like XLA's). No effect on CPU.
import jax  # pylint: disable=wrong-import-position

jax.config.update("jax_default_matmul_precision", "highest")
