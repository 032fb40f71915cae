"""Where a test's time goes in JAX: a pytest plugin, off unless asked for.

  python -m pytest -p compile_report -n 2 tests/variants/   # then:
  python tests/compile_report.py                            # the report

For each test it counts the programs XLA compiled and sums JAX's own timers
(tracing to a jaxpr, lowering to MLIR, the backend compile) beside the test's
wall time; each process writes its counts to `COMPILE_REPORT_DIR` (default
/tmp/attention_jax_compile_report) when it exits. A test that compiles tens of
programs runs op by op (eager `init`/`apply`, pure functions called outside
`jax.jit`); one whose wall time is not JAX's runs a subprocess or slow code.
Eager ops are cached per worker, so the first of a parametrized family pays
for the rest: read the counts per family, not per case.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import sys
import time

DIRECTORY = os.environ.get("COMPILE_REPORT_DIR", "/tmp/attention_jax_compile_report")
EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "compile"}

_per_test: dict = {}
_current = [None]


def _listen(event, duration, **_):
  name = EVENTS.get(event)
  if name is not None and _current[0] is not None:
    counts = _per_test.setdefault(_current[0], collections.Counter())
    counts[name] += duration
    if name == "compile":
      counts["programs"] += 1


def pytest_configure(config):  # pylint: disable=unused-argument
  from jax import monitoring  # pylint: disable=import-outside-toplevel
  monitoring.register_event_duration_secs_listener(_listen)


def pytest_unconfigure(config):  # pylint: disable=unused-argument
  # At the session's end in each process (xdist workers included); an atexit
  # hook ran in only one of the two workers.
  _write()


def pytest_runtest_protocol(item, nextitem):  # pylint: disable=unused-argument
  _current[0] = item.nodeid
  _per_test.setdefault(item.nodeid, collections.Counter())["start"] = time.time()


def pytest_runtest_logfinish(nodeid, location):  # pylint: disable=unused-argument
  counts = _per_test.get(nodeid)
  if counts is not None:
    counts["wall"] = time.time() - counts.pop("start")
  _current[0] = None


def _write():
  os.makedirs(DIRECTORY, exist_ok=True)
  with open(os.path.join(DIRECTORY, f"{os.getpid()}.json"), "w", encoding="utf-8") as file:
    json.dump({test: dict(counts) for test, counts in _per_test.items()}, file)


def report(directory: str = DIRECTORY, top: int = 30) -> str:
  """Totals, then the files and the tests that compile the most programs."""
  tests = {}
  for path in glob.glob(os.path.join(directory, "*.json")):
    with open(path, encoding="utf-8") as file:
      tests.update(json.load(file))
  keys = ("wall", "programs", "trace", "lower", "compile")
  total = collections.Counter()
  files = collections.defaultdict(collections.Counter)
  for test, counts in tests.items():
    total.update({k: counts.get(k, 0) for k in keys})
    files[test.split("::")[0]].update({k: counts.get(k, 0) for k in keys})

  def line(counts, name):
    return (f"{counts['wall']:8.1f} {counts['programs']:7.0f} {counts['trace']:7.1f} "
            f"{counts['lower']:7.1f} {counts['compile']:8.1f}  {name}")

  header = f"{'wall s':>8} {'programs':>7} {'trace':>7} {'lower':>7} {'compile':>8}"
  lines = [f"{len(tests)} tests", header, line(total, "all"), "", header]
  by_programs = lambda item: -item[1].get("programs", 0)
  lines += [line(c, f) for f, c in sorted(files.items(), key=by_programs)[:top]]
  lines += ["", header]
  lines += [line(collections.Counter(c), t) for t, c in sorted(tests.items(), key=by_programs)[:top]]
  return "\n".join(lines)


if __name__ == "__main__":
  print(report(*sys.argv[1:2]))
