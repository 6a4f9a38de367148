"""meshfuse: transformer kernels (RMSNorm, SwiGLU, softmax, cross-entropy, GEMM, ...) forward and
backward on whatever device holds the data.

The functions of this module take DLPack arrays (PyTorch, NumPy, CuPy, JAX) for every input and
for caller-allocated outputs, and write the outputs in place; they mirror the C++ API one to one
(see include/meshfuse/ops/*.h for shapes, dtypes, math and errors). ``meshfuse.torch`` wraps them
as PyTorch functions that allocate their outputs and take the current CUDA stream.

Errors raise ``meshfuse.Error`` (a RuntimeError) whose message names the op, the argument, what
was expected and what came.
"""

from ._meshfuse import *  # noqa: F401,F403
from ._meshfuse import Error, force_kernel_backend, version  # noqa: F401

__version__ = version()
