"""Helpers the tests share (pytest fixtures)."""

import pytest


def _made_like(shape, run):
    """The (op, dtype) of every tensor of ``shape`` in new memory (not a view or in place) that
    torch makes while ``run()`` runs, in order."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Made(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor) and o.shape == shape and not any(
                        isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() ==
                        o.untyped_storage().data_ptr() for a in args):
                    self.made.append((str(func), o.dtype))
            return out

    with Made() as made:
        run()
    return made.made


@pytest.fixture
def made_like():
    """_made_like, for the tests that count the memory an op makes (skipped without torch)."""
    pytest.importorskip("torch")
    return _made_like
