"""A stand-in `flash_attn` package over cuflash.torch, so that flash-attn's own test files run
against cuflash's kernels unchanged (tools/flash_attn_tests.py). Not installed with cuflash."""
from cuflash.torch import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                           flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                           flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]
