"""flash-attn 3's Python interface (its `flash_attn_interface` module) on cuflash's torch ops, for
code written against FlashAttention-3:

    import cuflash.torch_fa3 as flash_attn_interface

The functions keep flash-attn 3's names, positional order, defaults and return values, which differ
from flash-attn 2's (cuflash.torch): no dropout_p or alibi_slopes; `flash_attn_func(q, k, v,
softmax_scale, causal, ...)`; return_attn_probs gives (out, softmax_lse); the KV cache's table is
`page_table`. They run cuflash.torch's ops, so eager calls, autograd and torch.compile behave as
there. Arguments that only tune flash-attn 3's kernels (num_splits of the dense and varlen calls,
pack_gqa, sm_margin, scheduler_metadata) are accepted and have no effect: cuflash's dispatch makes
those choices. Features cuflash does not have raise NotImplementedError naming the argument: qv,
attention_chunk, and flash_attn_with_kvcache's packed queries (cu_seqlens_q, cu_seqlens_k_new,
max_seqlen_q), rotary_seqlens and fp8 queries (q_descale). flash_attn_varlen_func's seqused_q and
seqused_k are cuflash.attention_varlen's (out and the gradients hold 0 in the rows past them, where
flash-attn 3 leaves them unwritten).
"""

from __future__ import annotations

import torch

from . import torch as _fa2

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
           "flash_attn_combine"]


def _refuse(function: str, **given) -> None:
    """NotImplementedError for the first flash-attn 3 feature in `given` that a call sets (not None, not 0)."""
    for name, value in given.items():
        if value is not None and not (isinstance(value, (int, float)) and value == 0):
            raise NotImplementedError(f"{function}: {name} (flash-attn 3's) is not supported by cuflash; "
                                      f"pass {name}=None" + (" or 0" if name == "attention_chunk" else ""))


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                    pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    """flash-attn 3's `flash_attn_func`: q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k,
    nheads_kv, headdim), float16, bfloat16 or float8_e4m3fn (forward only, with q/k/v_descale float32
    (batch, nheads_kv)). Returns out; with return_attn_probs, (out, softmax_lse (batch, nheads, seqlen_q))."""
    _refuse("flash_attn_func", qv=qv, attention_chunk=attention_chunk)
    result = _fa2.flash_attn_func(q, k, v, 0.0, softmax_scale, causal, window_size, softcap, None, deterministic,
                                  return_attn_probs, q_descale, k_descale, v_descale)
    return result[:2] if return_attn_probs else result


def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None, k_descale=None,
                              v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                              deterministic=False, num_heads_q=None, sm_margin=0, return_attn_probs=False):
    """flash-attn 3's `flash_attn_qkvpacked_func`: qkv (batch, seqlen, 3, nheads, headdim), or with
    num_heads_q (batch, seqlen, num_heads_q + 2 * nheads_kv, headdim), q's heads then k's then v's."""
    if num_heads_q is None:
        if qkv.dim() != 5 or qkv.shape[2] != 3:
            raise ValueError(f"qkv must have shape (batch, seqlen, 3, nheads, headdim) without num_heads_q, "
                             f"got {tuple(qkv.shape)}")
        q, k, v = qkv.unbind(dim=2)
    else:
        heads = qkv.shape[2] if qkv.dim() == 4 else -1
        if heads < 0 or not 0 < num_heads_q < heads or (heads - num_heads_q) % 2:
            raise ValueError(f"qkv must have shape (batch, seqlen, num_heads_q + 2 * nheads_kv, headdim) with "
                             f"num_heads_q = {num_heads_q}, got {tuple(qkv.shape)}")
        q, k, v = qkv.split([num_heads_q, (heads - num_heads_q) // 2, (heads - num_heads_q) // 2], dim=2)
    return flash_attn_func(q, k, v, softmax_scale, causal, None, q_descale, k_descale, v_descale, window_size,
                           attention_chunk, softcap, 1, None, deterministic, sm_margin, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None,
                           k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                           num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    """flash-attn 3's `flash_attn_varlen_func`: q (total_q, nheads, headdim), k and v (total_k,
    nheads_kv, headdim), cu_seqlens int32 CUDA tensors (batch + 1,). Returns out; with
    return_attn_probs, (out, softmax_lse (nheads, total_q))."""
    _refuse("flash_attn_varlen_func", qv=qv, attention_chunk=attention_chunk)
    if q_descale is not None or k_descale is not None or v_descale is not None:
        raise NotImplementedError("flash_attn_varlen_func: fp8 descales are not supported by cuflash's torch "
                                  "varlen op (cuflash.attention_varlen takes them)")
    result = _fa2.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0,
                                         softmax_scale, causal, window_size, softcap, None, deterministic,
                                         return_attn_probs, seqused_q=seqused_q, seqused_k=seqused_k)
    return result[:2] if return_attn_probs else result


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                            cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                            return_softmax_lse=False):
    """flash-attn 3's `flash_attn_with_kvcache` (cuflash.attention_with_kvcache): q (batch, seqlen_q,
    nheads, headdim) float16 or bfloat16; a contiguous cache (batch_cache, seqlen_cache, nheads_kv,
    headdim) or, with page_table int32 (batch, max_pages), a paged one (num_pages, page_size, nheads_kv,
    headdim), page_size a multiple of 16; an e4m3 cache with k_descale / v_descale float32
    (batch, nheads_kv) (broadcast views are taken). Appends k, v in place, then attends. Returns out;
    with return_softmax_lse, (out, softmax_lse (batch, nheads, seqlen_q), out_accum, softmax_lse_accum),
    the last two empty, as flash-attn 3 returns them when it does not split (cuflash keeps its split
    partials to itself)."""
    _refuse("flash_attn_with_kvcache", qv=qv, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k_new=cu_seqlens_k_new,
            max_seqlen_q=max_seqlen_q, rotary_seqlens=rotary_seqlens, q_descale=q_descale,
            attention_chunk=attention_chunk)
    k_descale, v_descale = (None if x is None else x.contiguous() for x in (k_descale, v_descale))
    result = _fa2.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                         cache_batch_idx, cache_leftpad, page_table, softmax_scale, causal,
                                         window_size, softcap, rotary_interleaved, None, num_splits,
                                         return_softmax_lse, k_descale, v_descale)
    if not return_softmax_lse:
        return result
    empty = q.new_empty((0,), dtype=torch.float32)
    return (*result, empty, empty)


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """flash-attn 3's `flash_attn_combine` (cuflash.combine_partials): out_partial float32 (num_splits,
    batch, seqlen, nheads, headdim), lse_partial float32 (num_splits, batch, seqlen, nheads). Returns
    (out (batch, seqlen, nheads, headdim), of out_dtype (out_partial's by default) or written to out,
    softmax_lse (batch, seqlen, nheads))."""
    if not isinstance(lse_partial, torch.Tensor) or lse_partial.dim() != 4:
        raise ValueError("lse_partial must be a torch.Tensor of shape (num_splits, batch, seqlen, nheads), got "
                         f"{tuple(getattr(lse_partial, 'shape', ()))}")
    dtype = out.dtype if out is not None else out_dtype or out_partial.dtype
    merged, lse = _fa2.combine_partials(out_partial, lse_partial.transpose(2, 3), dtype)
    if out is not None:
        out.copy_(merged)
        merged = out
    return merged, lse.transpose(1, 2)
