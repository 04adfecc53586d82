"""The padding helpers flash-attn's tests import, written for this stand-in: rows of a padded
(batch, seqlen, ...) tensor where a mask is set, packed, and back."""
import torch
import torch.nn.functional as F


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """(packed rows, their flat indices, cu_seqlens int32, the longest length, lengths) of the rows of
    hidden_states (batch, seqlen, ...) where attention_mask (batch, seqlen) is set (or unused_mask,
    whose rows are packed too but not counted in the lengths)."""
    every = attention_mask if unused_mask is None else attention_mask | unused_mask
    lengths = every.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(every.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, int(lengths.max().item()), used


def pad_input(hidden_states, indices, batch, seqlen):
    """The packed rows of hidden_states back at their flat indices of a zero (batch, seqlen, ...) tensor."""
    out = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
    out[indices] = hidden_states
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
