"""What the torch test files share: torch itself (a file that imports this skips without it) and
float16 CUDA tensors from NumPy arrays (bit for bit). Their `torch_cuda` fixture is in conftest.py."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")


def half(x):
    """A float16 NumPy array as a CUDA tensor, the same bits."""
    return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.float16).cuda()


def leaves(host):
    """half() of each array, requiring gradients."""
    return [half(x).requires_grad_() for x in host]
