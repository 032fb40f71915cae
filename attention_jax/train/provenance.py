"""Where a measurement came from: the code's git revision and the machine that ran it.

Every results file records both, so a table says which commit and which devices
made each figure. On CPU the device kind is only "cpu", yet float rounding (and so
a training run's figures) differs between processors: XLA's CPU compiler emits
code for the host's own vector instructions (LLVM's host CPU detection), so the
same program sums in a different order on an AVX-512 machine than on an AVX2 one.
The summary therefore names the processor and those instruction sets too.
"""

from __future__ import annotations

import os
import pathlib
import platform
import subprocess
from typing import Any, Dict, Optional, Tuple

import jax

# Folders of measured outputs: a reproduction writes its cells into results/,
# which git tracks, so counting them would mark every cell after the first
# "+dirty" although the code measured is the commit's.
OUTPUT_FOLDERS = ("results", "benchmarks")

# The x86 vector extensions that decide how XLA's CPU code generator vectorises
# reductions and matrix products (and so how float sums are rounded).
_VECTOR_ISA_PREFIXES = ("sse4", "avx", "fma", "amx", "f16c")
_CPUINFO = pathlib.Path("/proc/cpuinfo")


def git_revision() -> Optional[str]:
  """HEAD of the checkout this package runs from (with "+dirty" for uncommitted
  changes to anything but `OUTPUT_FOLDERS`), or None outside a git checkout.

  $ATTENTION_JAX_GIT_REVISION, when set, is returned instead: a copy of the tree
  sent to another machine (a lent GPU's) carries a `.git` that need not describe
  it, so the sender names the clean commit it sent (experiments/gpu_session.sh).
  """
  if os.environ.get("ATTENTION_JAX_GIT_REVISION"):
    return os.environ["ATTENTION_JAX_GIT_REVISION"]
  root = pathlib.Path(__file__).resolve().parents[2]
  try:
    revision = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", "."]
        + [f":(exclude){folder}" for folder in OUTPUT_FOLDERS],
        cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None
  return revision + ("+dirty" if dirty else "")


def host_cpu(cpuinfo: Optional[str] = None) -> Tuple[str, Tuple[str, ...]]:
  """(the processor's model name, its vector instruction sets, sorted).

  Args:
    cpuinfo: the text of /proc/cpuinfo (read when None; elsewhere than Linux the
      model comes from `platform.processor()` and the instruction sets are unknown).
  """
  if cpuinfo is None:
    try:
      cpuinfo = _CPUINFO.read_text()
    except OSError:
      cpuinfo = ""
  model, flags = "", ()
  for line in cpuinfo.splitlines():
    name, _, value = line.partition(":")
    name = name.strip()
    if name == "model name" and not model:
      model = value.strip()
    elif name in ("flags", "Features") and not flags:  # x86 / Arm
      flags = tuple(sorted({flag for flag in value.split()
                            if flag.startswith(_VECTOR_ISA_PREFIXES) or flag in ("asimd", "sve")}))
  return model or platform.processor() or platform.machine() or "unknown", flags


def device_summary() -> Dict[str, Any]:
  """The devices a run used: kind, platform, counts; on CPU also the processor's
  model (`cpu_model`) and vector instruction sets (`cpu_isa`)."""
  device = jax.devices()[0]
  summary = dict(kind=device.device_kind, platform=device.platform, count=jax.device_count(),
                 local_count=jax.local_device_count(), process_count=jax.process_count())
  if device.platform == "cpu":
    model, isa = host_cpu()
    summary.update(cpu_model=model, cpu_isa=list(isa))
  return summary


def describe_devices(devices: Dict[str, Any]) -> str:
  """"1 x cpu (AMD EPYC; avx, avx2, fma)" from a `device_summary` (or an older
  results file's, which has no processor fields: "1 x cpu")."""
  text = f"{devices.get('count')} x {devices.get('kind')}"
  if devices.get("cpu_model"):
    isa = devices.get("cpu_isa") or []
    text += f" ({devices['cpu_model']}" + (f"; {', '.join(isa)}" if isa else "") + ")"
  return text
