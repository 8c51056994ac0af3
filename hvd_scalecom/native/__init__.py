"""ScaleCom's per-tensor passes (``scalecom_kernels.c``) and the count sketch of Sketched SGD
(``sketch_kernels.c``) in C, called through ctypes on raw pointers.

The sources ship with the package and are compiled at first use with the system C compiler
(``$CC``, else ``cc``/``gcc``; ``-O3 -march=native``, then any of ``$HVD_SCALECOM_CFLAGS``, e.g.
``-mno-avx512f`` to build the loops of CPUs without AVX-512) into one library in
``$HVD_SCALECOM_CACHE/native`` (default ``~/.cache/hvd_scalecom/native``; the installer keeps
Horovod's wheels in ``$HVD_SCALECOM_CACHE`` too), keyed by the sources, the flags, the compiler and
the CPU's features, so that processes starting together or nodes sharing a home directory never load
a library built for another CPU. :func:`library` returns None (and warns once) where no compiler
works, or where ``HVD_SCALECOM_NATIVE=0`` (read once, at the first call): the callers then use
torch operations, which compute the same values (up to which entries tied at the k-th magnitude a
leader takes: its indices travel to the other ranks; Sketched SGD's candidates, which every rank finds
itself, are put in one order either way), so ranks may mix both; :func:`torch_operations` does the
same for a block of code.
"""

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings

SOURCE_PATHS = tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
                     for name in ("scalecom_kernels.c", "sketch_kernels.c"))
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]

_library = None
_tried = False
_enabled = None  # HVD_SCALECOM_NATIVE, read at the first call (the callers ask at every call)


def enabled():
    """False when ``HVD_SCALECOM_NATIVE`` is set to 0 (use torch operations only)."""
    global _enabled
    if _enabled is None:
        _enabled = os.environ.get("HVD_SCALECOM_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")
    return _enabled


@contextlib.contextmanager
def torch_operations():
    """Within the block, :func:`library` returns None: the callers use torch operations."""
    global _enabled
    before = enabled()
    _enabled = False
    try:
        yield
    finally:
        _enabled = before


def library():
    """The compiled kernels (a ``ctypes.CDLL``), or None where they are disabled or cannot be built."""
    global _library, _tried
    if not enabled():
        return None
    if not _tried:
        _tried = True
        try:
            _library = _declare(ctypes.CDLL(_build()))
        except (OSError, RuntimeError) as err:
            warnings.warn(f"hvd_scalecom: the C kernels are unavailable ({err}); using torch operations "
                          f"(slower on the CPU, same results)", RuntimeWarning, stacklevel=2)
    return _library


def loaded():
    """The kernels if an earlier :func:`library` call loaded them, even where they are disabled now:
    for a step that a C pass began (the second pass of a pair must not switch paths midway)."""
    return _library


def _cpu_features():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _build():
    chosen = os.environ.get("CC")
    if chosen:  # (the compiler asked for, or none: another would be built and cached unnoticed)
        compiler = shutil.which(chosen)
        if compiler is None:
            raise RuntimeError(f"CC={chosen} is not found")
    else:
        compiler = shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise RuntimeError("no C compiler found (neither cc nor gcc; set CC)")
    flags = FLAGS + os.environ.get("HVD_SCALECOM_CFLAGS", "").split()
    sources = []
    for path in SOURCE_PATHS:
        with open(path, "rb") as f:
            sources.append(f.read())
    key = hashlib.sha256(b"\0".join([*sources, " ".join(flags).encode(), os.path.realpath(compiler).encode(),
                                     _cpu_features().encode()])).hexdigest()[:20]
    cache = os.path.join(os.environ.get("HVD_SCALECOM_CACHE",
                                        os.path.join(os.path.expanduser("~"), ".cache", "hvd_scalecom")), "native")
    target = os.path.join(cache, f"scalecom_kernels_{key}.so")
    if os.path.exists(target):
        return target
    os.makedirs(cache, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=".building_", suffix=".so", dir=cache)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, "-o", partial, *SOURCE_PATHS, "-lm"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(partial, target)  # atomic: ranks building at once each install a whole library
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return target


def _declare(lib):
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    lib.hsc_select.restype = i64
    lib.hsc_select.argtypes = [ptr, ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, ptr, ptr, i32, ptr, ptr, ptr, ptr]
    lib.hsc_take.restype = i32
    lib.hsc_take.argtypes = [ptr, ptr, i64, ptr, i64, ptr, ptr, i32]
    lib.hsc_filter_scatter.restype = i32
    lib.hsc_filter_scatter.argtypes = [ptr, ptr, i64, f32, f32, ptr, i32, i64, ptr, ptr]
    lib.has_cut_pass = hasattr(lib, "hsc_filter_scatter_cut")  # built with AVX-512
    if lib.has_cut_pass:
        lib.hsc_filter_scatter_cut.restype = i32
        lib.hsc_filter_scatter_cut.argtypes = [ptr, ptr, i64, f32, f32, f32, i64, i64, ptr]
    lib.hsc_mark.restype = i32
    lib.hsc_mark.argtypes = [ptr, i32, i64, i64, ptr]
    lib.hsc_take_advancing.restype = i32
    lib.hsc_take_advancing.argtypes = [ptr, ptr, i64, f32, f32, ptr, ptr]
    lib.hsc_scatter_marked.restype = None
    lib.hsc_scatter_marked.argtypes = [ptr, i64, ptr, ptr]
    lib.hsc_scatter_if_finite.restype = i32
    lib.hsc_scatter_if_finite.argtypes = [ptr, ptr, i64, ptr, ptr, i64]
    lib.hsc_all_finite.restype = i32
    lib.hsc_all_finite.argtypes = [ptr, i64]
    lib.hsc_fused_pass.restype = None
    lib.hsc_fused_pass.argtypes = [ptr, ptr, i64, f32]
    lib.hsc_sketch.restype = i32
    lib.hsc_sketch.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr]
    lib.hsc_estimate.restype = i32
    lib.hsc_estimate.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr]
    lib.hsc_sketch_lanes.restype = i32
    lib.hsc_sketch_lanes.argtypes = []
    return lib
