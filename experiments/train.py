"""Trains one config: `python -m experiments.train --config=FILE[:ARG] --workdir=DIR`.

  python -m experiments.train --config=configs/lra/listops.py:performer,smoke \\
      --workdir=runs/listops-performer --config.num_train_steps=300

`--config.a.b=value` overrides any config key. Running the same command again
resumes the run in the workdir (or does nothing more if it finished); a workdir
holding a run of a different config is refused unless `--overwrite` is given,
which moves that run aside. On several hosts start the same command on each:
`jax.distributed.initialize()` is called when the environment describes a
multi-process job (see `distributed_requested`).
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "the experiment config file[:arg]",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "where checkpoints, metrics and results go")
_OVERWRITE = flags.DEFINE_bool("overwrite", False,
                               "move aside a run of a different config in --workdir")
flags.mark_flags_as_required(["config", "workdir"])

# Environment variables by which launchers describe a multi-process job; jax's
# `distributed.initialize()` reads the coordinates from them itself.
_MULTI_PROCESS_ENV = ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE",
                      "TPU_WORKER_HOSTNAMES")


def distributed_requested(environ=os.environ) -> bool:
  """True when a launcher asks for more than one process."""
  if environ.get("JAX_COORDINATOR_ADDRESS"):
    return True
  for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    if environ.get(name, "1").isdigit() and int(environ.get(name, "1")) > 1:
      return True
  return "," in environ.get("TPU_WORKER_HOSTNAMES", "")


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    # Orbax and jax log every checkpoint step at INFO; the progress bar and the
    # trainer's messages say what matters. --verbosity=0 brings them back.
    logging.set_verbosity(logging.WARNING)
  import jax  # pylint: disable=g-import-not-at-top
  if distributed_requested():
    jax.distributed.initialize()
  from attention_jax.train.trainer import train_and_evaluate  # pylint: disable=g-import-not-at-top
  try:
    results = train_and_evaluate(_CONFIG.value, _WORKDIR.value, overwrite=_OVERWRITE.value)
  except ValueError as e:  # Bad input: say what and stop, without a traceback.
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  if jax.process_index() == 0:
    metrics = results["metrics"]
    summary = dict(validation=metrics["validation"], test=metrics.get("test"),
                   steps_per_s=metrics["steps_per_s"],
                   peak_memory_bytes=metrics["peak_memory_bytes"])
    print(json.dumps(summary, default=str))


if __name__ == "__main__":
  app.run(main)
