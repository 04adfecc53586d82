"""The two names flash-attn's tests take from flash_attn.flash_attn_interface."""

USE_TRITON_ROCM = False


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """The key block over which flash-attn's tests rescale return_attn_probs' values: read only by the
    dropout cases that fa_select.py leaves out; one block."""
    return 1 << 30
