"""The installed Horovod runs collectives from both frontends, under Gloo and under MPI."""

import numpy as np
import pytest
from jobs import add_run


def expected(size):
    return {
        "sum": sum(np.arange(5) + 10 * r for r in range(size)),
        "avg": np.full(3, np.mean(range(size))),
        "bcast": np.full(4, float(size)),
    }


CASES = [("torch", "gloo", 2), ("tensorflow", "gloo", 2), ("torch", "mpi", 2), ("tensorflow", "mpi", 3)]


def job_of(framework, controller, size):
    """The shared job of tests/jobs.py with this set-up."""
    return f"{'torch' if framework == 'torch' else 'tf'}_np{size}{'_mpi' if controller == 'mpi' else ''}"


for framework, controller, size in CASES:
    add_run(job_of(framework, controller, size), f"smoke_{framework}_{controller}_np{size}", "smoke.py",
            {"framework": framework}, ["test_collectives"])


@pytest.mark.parametrize("framework, controller, size", CASES)
def test_collectives(horovod_jobs, framework, controller, size):
    results = horovod_jobs(job_of(framework, controller, size)).completed(f"smoke_{framework}_{controller}_np{size}")
    assert len(results) == size
    for r in results:
        assert int(r["size"]) == size
        for key, value in expected(size).items():
            np.testing.assert_allclose(r[key], value, err_msg=key)
