"""Test-session settings.

The tests check values, not speed, and most of their time on CPU goes to XLA
compiling many small programs; `TEST_XLA_FLAGS` make each compile cheaper.
Set XLA_FLAGS yourself to override any of them, or ATTENTION_JAX_TEST_XLA_FLAGS=0
to add none (on an accelerator, whose XLA version may not know the CPU flags).
"""

import atexit
import gc
import importlib.metadata
import os
import pathlib
import re
import shutil
import tempfile

# Each flag is added unless XLA_FLAGS already sets it. Measured on the 2-core CI
# machine (tests/variants/test_linear.py, one process: 163 s with the first
# flag alone, 92 s with all three; backend compile time 114 s -> 41 s):
# * the backend's optimisation level 0 (about fivefold on its own);
# * XLA:CPU's older loop emitters instead of its MLIR fusion emitters, which
#   compile a small program in about half the time;
# * code generation in one piece: the two test workers already use both cores.
# * XLA:CPU's fast-compile preset (stop 63, on top of the three: test_linear.py
#   with test_funnel.py in one process, alternating, 134 and 120 s against 144
#   and 140 s). XLA refuses a flag it does not know, and the preset is newer
#   than the oldest jaxlib we allow, so it is asked for only from the jaxlib it
#   was measured on.
TEST_XLA_FLAGS = {
    "xla_backend_optimization_level": "0",
    "xla_cpu_use_fusion_emitters": "false",
    "xla_cpu_parallel_codegen_split_count": "1",
}
if tuple(int(part) for part in re.findall(r"\d+", importlib.metadata.version("jaxlib"))[:2]) >= (0, 10):
  TEST_XLA_FLAGS["xla_cpu_opt_preset"] = "CPU_OPT_PRESET_FAST_COMPILE"
# Of these, the optimisation level and the preset make the compiled code slow: a
# subprocess that mostly runs its programs drops them (tests/attention_testing.py,
# `runtime_bound_environment`).
for _flag, _value in TEST_XLA_FLAGS.items():
  if os.environ.get("ATTENTION_JAX_TEST_XLA_FLAGS") == "0":
    break
  if f"--{_flag}=" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_flag}={_value}".strip()

# One persistent compilation cache for the session: the two xdist workers and
# the subprocess runs compile many of the same small programs (eager ops of
# model inits, the same layer shapes in different files), and a hit costs a
# file read where a compile costs ~20 ms. It starts empty, so CI times the cold
# case; the first process to load this file (the xdist controller) makes it and
# the workers inherit it through the environment. JAX caches by the program,
# the flags and its own version, so a hit is the program it compiled.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache_dir = tempfile.mkdtemp(prefix="attention_jax_xla_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
  # Every compile is worth keeping: the default keeps only those over a second.
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)

# float32 matrix products in float32. On GPUs XLA (and Triton inside the Pallas
# kernels) run float32 dots as TF32 by default, ~1e-3 off the float32 reference;
# the tests check the algorithms at float32 tolerances, so they ask for float32
# (the kernels' dots follow this setting like XLA's). No effect on CPU.
import jax  # pylint: disable=wrong-import-position
import pytest  # pylint: disable=wrong-import-position

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_finish(session):
  """The cyclic garbage collector off the objects that live for the session.

  A worker ends holding some 2.5 million tracked objects (JAX's trace, lowering
  and executable caches, the imported modules), and each full collection walks
  them all: 32-41 s per worker of a 1,013 s suite at cc6e573 (gc callbacks on
  both xdist workers). Freezing what exists after collection and collecting
  young objects less often leaves tests/variants at 3 s of collection per worker
  instead of 19 (407 s against 425 s wall, one run each; peak memory unchanged,
  4.6 GB a worker): objects without cycles are still freed by reference counts.
  """
  del session
  gc.collect()
  gc.freeze()
  gc.set_threshold(20_000, 20, 10)


# A module-scoped fixture matches this (tests/**/test_*.py); its file runs whole on
# one xdist worker (below).
MODULE_FIXTURE = re.compile(r"@pytest\.fixture\(scope=[\"']module[\"']")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """xdist's "load" scheduling, except that a file with a module-scoped fixture
  goes whole to one worker.

  Those fixtures are the costly ones (a subprocess on 8 simulated devices, a
  benchmark run, a trained checkpoint: 5-30 s each), and under "load" a file's
  tests land on both workers, each of which builds the fixture: the 8-device
  runner cost 24 s and 34 s on the two workers of one suite run at c471434.
  (xdist's own `--dist loadgroup` would do this from `xdist_group` marks, but
  pytest-xdist 3.8 renames the node ids through an attribute pytest 9.2 no
  longer reads, so its groups never form.) Files go first, largest first, then
  the other tests one by one in collection order, as "loadgroup" orders them.
  """
  if config.getvalue("dist") != "load":  # another --dist asked for by name
    return None
  from xdist.scheduler import LoadScopeScheduling  # pylint: disable=import-outside-toplevel
  tests = pathlib.Path(__file__).parent
  shared = {path.relative_to(tests.parent).as_posix() for path in tests.rglob("test_*.py")
            if MODULE_FIXTURE.search(path.read_text())}

  class SharedFixtureScheduling(LoadScopeScheduling):

    def _split_scope(self, nodeid):
      path = nodeid.split("::", 1)[0]
      return path if path in shared else nodeid

  return SharedFixtureScheduling(config, log)
