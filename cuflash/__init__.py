"""cuflash: exact FlashAttention for CuPy arrays."""

from . import reference
from .api import attention
from .backward import attention_backward, attention_vjp

__all__ = ["attention", "attention_backward", "attention_vjp", "reference"]
__version__ = "0.1.0"
