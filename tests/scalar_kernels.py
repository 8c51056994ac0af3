"""A test file run again against the C kernels built without AVX-512 (and without AVX2 too), so that
the loops CPUs without them run are held to the same tests as the AVX-512 ones."""

import os
import subprocess
import sys

import pytest

SCALAR_BUILD = "HVD_SCALECOM_TEST_SCALAR_BUILD"  # set in the rerun: the kernels there are scalar


def rerun_with_scalar_kernels(test_file, tmp_path, flags="-mno-avx512f"):
    """``pytest test_file`` in a subprocess whose kernels are built with ``flags`` added (default:
    ``-mno-avx512f``; ``HVD_SCALECOM_CFLAGS``) into an empty cache; asserts that every test passed
    there and one library was built."""
    if os.environ.get(SCALAR_BUILD):
        pytest.skip("already the scalar build")
    env = {**os.environ, "HVD_SCALECOM_CFLAGS": flags, "HVD_SCALECOM_CACHE": str(tmp_path / "cache"),
           SCALAR_BUILD: "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
    assert len(list((tmp_path / "cache" / "native").glob("scalecom_kernels_*.so"))) == 1
