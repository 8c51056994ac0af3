"""``horovodrun`` itself (Horovod's ``run_commandline``), asking Horovod's PyTorch extension before its
TensorFlow one whether Horovod was built with Gloo or MPI.

    python devtools/horovodrun.py -np 2 -H localhost:2 --gloo python train.py

Before every job ``horovodrun`` checks that its controller was built by importing a framework's Horovod
extension in a forked process, TensorFlow's first: about 4 s of CPU per job, where PyTorch's extension
answers the same question in about 1.5 s. Every Horovod extension of an installation is built with the
same controllers, so the answer is the same; nothing else of the launcher changes.
:func:`devtools.launch.sooner_launcher` starts the ``horovodrun`` beside this Python this way (the
tests' and benchmarks' jobs).
"""

import sys

import horovod.common.util as horovod_util
from horovod.runner.launch import run_commandline

if __name__ == "__main__":
    horovod_util.EXTENSIONS[:] = ["torch"] + [e for e in horovod_util.EXTENSIONS if e != "torch"]
    sys.exit(run_commandline())
