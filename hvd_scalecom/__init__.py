"""hvd_scalecom: ScaleCom gradient compression (Chen et al., NeurIPS 2020) for Horovod.

Framework-neutral parts live here (``config``, ``traffic``, ``agreement``, ``state``, ``monitor``);
the frontends are ``hvd_scalecom.torch`` and ``hvd_scalecom.tensorflow``.
"""

from hvd_scalecom.config import ScaleComConfig

__version__ = "0.1.0"
__all__ = ["ScaleComConfig", "__version__"]
