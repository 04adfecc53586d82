"""cuflash: exact FlashAttention for CuPy arrays."""

from . import reference
from .api import attention

__all__ = ["attention", "reference"]
__version__ = "0.1.0"
