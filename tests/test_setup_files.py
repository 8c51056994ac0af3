"""The local set-up and both images install the same way, with versions pinned in one place."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(*path):
    with open(os.path.join(ROOT, *path)) as f:
        return f.read()


def test_dockerfiles_call_the_install_script():
    for name in ("Dockerfile", "Dockerfile.gpu"):
        text = read("docker", name)
        assert re.search(r"^RUN bash scripts/install\.sh", text, re.M), name
        # No package versions of their own: those live in scripts/versions.env only.
        assert not re.search(r"(torch|tensorflow|horovod|numpy|mpi4py)\S*==", text, re.I), name
    assert "HVD_SCALECOM_GPU=1" in read("docker", "Dockerfile.gpu")
    assert "download.pytorch.org/whl/cpu" in read("docker", "Dockerfile")  # torch's CPU build
    ignored = read(".dockerignore").split()
    assert ".venv" in ignored and ".git" in ignored  # COPY . . takes neither into an image


def test_setup_cfg_pins_nothing_the_installer_pins():
    """Horovod, torch and TensorFlow come from scripts/install.sh only (pip would build an
    unpatched Horovod)."""
    assert not re.search(r"^\s*(torch|tensorflow\S*|horovod)\s*[<>=]", read("setup.cfg"), re.M | re.I)


def test_versions_pinned_once():
    versions = dict(re.findall(r"^([A-Z_]+)=\"?([^\"\n]+)\"?$", read("scripts", "versions.env"), re.M))
    assert versions["TORCH_VERSION"] == "2.13.0"
    assert versions["HOROVOD_VERSION"] == "0.28.1"
    assert versions["TENSORFLOW_VERSION"].startswith("2.21")
    install = read("scripts", "install.sh")
    assert "source \"$here/versions.env\"" in install
    for value in ("2.13.0", "2.21", "0.28.1"):
        assert value not in install, f"install.sh repeats the version {value}"


def test_makefile_and_ci_use_the_installer():
    makefile = read("Makefile")
    assert re.search(r"^install:\n\tbash scripts/install\.sh", makefile, re.M)
    assert re.search(r"^demo: install$", makefile, re.M)
    # make test lints first (ruff, installed by the installer), then runs pytest
    assert re.search(r"^lint: install\n\t\$\(VENV\)/bin/ruff check \.$", makefile, re.M)
    # make test runs every test: the tests that start no processes, and every stream of the others
    recipe = re.search(r"^test: lint\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert '$(PY) -m pytest -q -m "not multiprocess" tests' in recipe
    from conftest import STREAMS
    assert re.findall(r"-m multiprocess --stream (\w+) tests", recipe) == ["torch", "rest", "links"] == list(STREAMS)
    ci = [line for line in read(".ci", "run").splitlines() if line and not line.startswith("#")]
    assert ci[-1] == "make test"


def test_installed_horovod_has_both_frameworks_and_controllers():
    """What ``horovodrun --check-build`` reports, asked of each framework's Horovod extension in this
    process (the command starts a Python per framework and controller to ask the same): both load,
    each built with MPI and Gloo."""
    import horovod.tensorflow as hvd_tf
    import horovod.torch as hvd_torch

    for name, hvd in (("TensorFlow", hvd_tf), ("PyTorch", hvd_torch)):
        assert hvd.mpi_built() and hvd.gloo_built(), f"Horovod's {name} extension: MPI {hvd.mpi_built()}, " \
                                                     f"Gloo {hvd.gloo_built()}"
