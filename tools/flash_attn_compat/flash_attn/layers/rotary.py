"""flash-attn's `apply_rotary_emb` as flash-attn's tests call it, in plain torch (float32, rounded to
x's dtype)."""
import torch


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """x (batch, seqlen, nheads, headdim) with its first rotary_dim = 2 cos.shape[1] columns turned by
    the angles of rows seqlen_offsets + i of cos and sin (seqlen_rotary, rotary_dim / 2); rows past the
    tables are left as they are. interleaved: pairs (x[2p], x[2p + 1]); else (x[p], x[p + rotary_dim / 2])."""
    if cu_seqlens is not None:
        raise NotImplementedError("this stand-in takes padded batches only")
    batch, seqlen = x.shape[:2]
    half = cos.shape[1]
    offsets = torch.as_tensor(seqlen_offsets, device=x.device).reshape(-1, 1)
    positions = (offsets + torch.arange(seqlen, device=x.device)).expand(batch, seqlen)
    inside = (positions < cos.shape[0]).unsqueeze(-1)
    rows = positions.clamp(max=cos.shape[0] - 1)
    c = torch.where(inside, cos[rows].float(), 1.0).unsqueeze(2)
    s = torch.where(inside, sin[rows].float(), 0.0).unsqueeze(2)
    rotated = x[..., :2 * half].float()
    if interleaved:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
        turned = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = rotated[..., :half], rotated[..., half:]
        turned = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    out = torch.cat((turned.to(x.dtype), x[..., 2 * half:]), dim=-1)
    if inplace:
        x.copy_(out)
        return x
    return out
