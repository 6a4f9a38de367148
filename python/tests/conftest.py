# torch and a meshfuse built with NCCL both need libnccl.so.2, and a process keeps the first one
# it loads. meshfuse links the system NCCL, torch ships a newer one: imported first, meshfuse's
# would make torch's import fail on a missing symbol (ncclCommResume). So torch goes first here,
# as the README tells users to do.
try:
    import torch  # noqa: F401
except ImportError:
    pass
