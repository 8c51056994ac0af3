"""Many-worker simulator of ScaleCom and the schemes it is compared with, in one process.

``Simulator(scheme, n_workers, named_parameters)`` holds n workers' state; each ``step`` takes their
gradients and returns the update every worker applies, the step's traffic (payload and bytes sent per
worker, indices and values apart) and diagnostics. ScaleCom runs through
:mod:`hvd_scalecom.torch.clt_k`, the code of the Horovod compressor.

Schemes: :class:`Dense`, :class:`FP16`, :class:`ScaleCom`, :class:`LocalTopK`, :class:`GlobalTopK`,
:class:`GTopK`, :class:`RandomK`, :class:`SketchedSGD`, :class:`QsparseLocalSGD`, :class:`PowerSGD`.
"""

from hvd_scalecom.sim.base import Scheme, TensorSpec
from hvd_scalecom.sim.powersgd import PowerSGD
from hvd_scalecom.sim.qsparse import QsparseLocalSGD
from hvd_scalecom.sim.simulator import Simulator, StepResult
from hvd_scalecom.sim.sketched import SketchedSGD
from hvd_scalecom.sim.sparse import FP16, Dense, GlobalTopK, GTopK, LocalTopK, RandomK, ScaleCom
from hvd_scalecom.sim.workers import per_worker_gradients
from hvd_scalecom.traffic import Collective, StepRecord

__all__ = ["Simulator", "StepResult", "Scheme", "TensorSpec", "StepRecord", "Collective",
           "Dense", "FP16", "ScaleCom", "LocalTopK", "GlobalTopK", "GTopK", "RandomK", "SketchedSGD",
           "QsparseLocalSGD", "PowerSGD", "per_worker_gradients"]
