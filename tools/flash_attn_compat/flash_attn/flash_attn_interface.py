"""The two names flash-attn's tests take from flash_attn.flash_attn_interface."""

USE_TRITON_ROCM = False


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """The key block over which flash-attn's tests rescale return_attn_probs' values (S_dmask) to the
    softmax: one block, as cuflash.torch scales each row of S_dmask so that its largest entry is 1."""
    return 1 << 30
