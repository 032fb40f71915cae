"""experiments/train.py: when it asks jax for a multi-process setup."""

import pytest

from experiments.train import distributed_requested


@pytest.mark.parametrize("environ, expected", [
    ({}, False),
    ({"SLURM_NTASKS": "1"}, False),
    ({"SLURM_NTASKS": "4"}, True),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, True),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, True),
    ({"TPU_WORKER_HOSTNAMES": "localhost"}, False),
    ({"TPU_WORKER_HOSTNAMES": "host-0,host-1"}, True),
])
def test_distributed_is_initialised_only_for_multi_process_jobs(environ, expected):
  assert distributed_requested(environ) is expected
