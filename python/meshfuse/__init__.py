"""meshfuse: transformer kernels (RMSNorm, SwiGLU, softmax, cross-entropy, GEMM, ...) forward and
backward on whatever device holds the data.

The functions of this module take DLPack arrays (PyTorch, NumPy, CuPy, JAX) for every input and
for caller-allocated outputs, and write the outputs in place; they mirror the C++ API one to one
(see include/meshfuse/ops/*.h for shapes, dtypes, math and errors). ``meshfuse.torch`` wraps them
as PyTorch functions that allocate their outputs and take the current CUDA stream.

``Program``, ``DeviceMesh``, ``Shard`` / ``Replicate`` / ``Partial``, ``MultiDeviceExecutor`` and
``grad`` build a program on global shapes and run it sharded over a mesh of ranks, taking and
returning DLPack arrays (docs/DISTRIBUTED.md, "From Python").

Errors raise a ``meshfuse.Error`` subclass per kind, each also the built-in exception of its kind
(``ShapeMismatchError`` is a ValueError, ``DTypeMismatchError`` a TypeError, ...; docs/PYTHON.md
lists them), whose message names the op, the argument, what was expected and what came.
``meshfuse.info()`` says what this build has (what ``meshfuse info`` prints).
"""

import ctypes as _ctypes
import os as _os
import sys as _sys

# The extension needs libstdc++; make it global before loading the extension. Loaded only locally
# (Python's default for extensions), it left torch, imported afterwards, resolving C++ runtime
# symbols (operator delete, std::string) in libc10_cuda to the private copy that the libcufile
# torch preloads globally carries, and the import aborted with "free(): invalid pointer" (seen
# with LD_DEBUG=bindings on the H200 machine, torch 2.11+cu130). Global, libstdc++ comes first in
# the lookup as when torch is imported alone.
try:
    _ctypes.CDLL("libstdc++.so.6", mode=_os.RTLD_GLOBAL)
except OSError:  # then loading the extension below fails too, and says why
    pass

# Intel MKL from PyPI (`pip install mkl`), which the cpu GEMMs run on where installed, lives in
# the interpreter's prefix (lib/), where the loader does not look. Opened here, locally, its soname
# is known to the process, and the library's first GEMM finds it (src/ops/gemm/cpu_blas.cpp) in
# whatever environment meshfuse was built.
_mkl = _os.path.join(_sys.prefix, "lib", "libmkl_rt.so.3")
if (not _os.environ.get("MESHFUSE_MKL_LIBRARY")
        and _os.environ.get("MESHFUSE_CPU_BLAS", "").lower() != "onednn" and _os.path.exists(_mkl)):
    try:
        _ctypes.CDLL(_mkl, mode=_os.RTLD_LOCAL)
    except OSError:  # then the library reports what it opens, or oneDNN
        pass

from ._meshfuse import *  # noqa: E402,F401,F403
from ._meshfuse import Error, force_kernel_backend, version  # noqa: E402,F401

__version__ = version()
