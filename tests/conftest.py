"""Shared fixtures: every multi-process test starts Horovod through ``devtools.launch.run``."""

import json
import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # tests/reference.py
sys.path.insert(1, os.path.dirname(HERE))  # devtools (the repository's tools, not installed)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def horovod_job(tmp_path):
    """``horovod_job(worker, opts, np=2, controller="gloo", env=None)`` runs ``tests/workers/<worker>``
    under horovodrun and returns ``(per-rank npz dicts, output)``."""
    from devtools.launch import run

    def launch(worker, opts=None, np=2, controller="gloo", env=None, timeout=300, out_dir=None):
        out_dir = str(out_dir or tmp_path)
        os.makedirs(out_dir, exist_ok=True)
        script = os.path.join(HERE, "workers", worker)
        output = run([script, json.dumps(opts or {}), out_dir], np=np, controller=controller,
                     env=env, timeout=timeout)
        results = []
        for rank in range(np):
            path = os.path.join(out_dir, f"rank{rank}.npz")
            if os.path.exists(path):
                with numpy_load(path) as data:
                    results.append({k: data[k] for k in data.files})
        return results, output

    return launch


def numpy_load(path):
    return np.load(path, allow_pickle=False)
