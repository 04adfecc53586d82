"""cuflash: exact FlashAttention for CuPy arrays."""

from . import backward, dispatch, reference, tune_bwd, tune_fwd
from .api import attention
from .backward import attention_backward, attention_vjp
from .tuner import autotune

# Tuned configurations take precedence over the heuristic table.
dispatch.set_cache_lookup(tune_fwd.lookup)
backward.set_cache_lookup(tune_bwd.lookup)

__all__ = ["attention", "attention_backward", "attention_vjp", "autotune", "reference"]
__version__ = "0.1.0"
