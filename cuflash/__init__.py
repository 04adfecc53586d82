"""cuflash: exact FlashAttention for CuPy arrays."""

from . import reference, tuner
from .backward import attention_backward, attention_vjp, backward_workspace
from .combine import combine_partials
from .dropout_mask import dropout_keep_mask
from .forward import attention
from .kv_cache import attention_with_kvcache
from .tuner import autotune
from .varlen import attention_varlen, attention_varlen_backward, attention_varlen_vjp

tuner.install()  # tuned configurations take precedence over dispatch's tables

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_backward", "attention_varlen_vjp",
           "attention_vjp", "attention_with_kvcache", "autotune", "backward_workspace", "combine_partials",
           "dropout_keep_mask", "reference"]
__version__ = "0.1.0"
