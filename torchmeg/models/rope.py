"""Rotary position embeddings (RoFormer, Su et al. 2021) and the context-extension rules public
checkpoints are trained with: Llama-3.1's frequency-dependent scaling ("llama3") and YaRN ("yarn",
Peng et al. 2023; DeepSeek-V3, Qwen long-context). The tables are computed in float64 from the same
formulas transformers uses (modeling_rope_utils), then cast to float32.

Shape legend: L positions, D head dim (the rotated part), B batch, H heads.
"""
from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "llama3", "yarn")


def inv_frequencies(dim: int, theta: float, a=None, device=None) -> tuple[torch.Tensor, float]:
    """theta^(-2i/dim) for i < dim/2, rescaled by the args' rope_type -> (inv_freq float64 [dim/2],
    attention factor: the scale YaRN puts on cos and sin, 1 otherwise). `a`: any args with the rope_*
    fields of LlamaArgs (None or rope_type "default": plain RoPE)."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))
    kind = getattr(a, "rope_type", "default") if a is not None else "default"
    if kind == "default":
        return inv, 1.0
    if kind == "llama3":
        return _llama3(inv, a), 1.0
    if kind == "yarn":
        return _yarn(inv, dim, theta, a)
    raise ValueError(f"rope_type {kind!r}: not one of {ROPE_TYPES}")


def _llama3(inv: torch.Tensor, a) -> torch.Tensor:
    """Llama 3.1: wavelengths beyond original_len / low_freq_factor are divided by `factor`, those
    below original_len / high_freq_factor kept, the band between interpolated smoothly."""
    factor, lo, hi, old = a.rope_factor, a.rope_low_freq_factor, a.rope_high_freq_factor, a.rope_original_max_seq_len
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(inv: torch.Tensor, dim: int, theta: float, a) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023, eq. 18-21): dimensions that rotate fewer than beta_slow times over the
    original context are interpolated (divided by `factor`), those rotating more than beta_fast times
    kept, a linear ramp between; cos/sin scaled by the attention factor (0.1 ln s + 1, or DeepSeek's
    mscale / mscale_all_dim ratio)."""
    factor, old = a.rope_factor, a.rope_original_max_seq_len
    if a.rope_attention_factor > 0:
        att = a.rope_attention_factor
    elif a.rope_mscale and a.rope_mscale_all_dim:
        att = yarn_mscale(factor, a.rope_mscale) / yarn_mscale(factor, a.rope_mscale_all_dim)
    else:
        att = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(a.rope_beta_fast), correction_dim(a.rope_beta_slow)
    if a.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (as transformers: no zero-width ramp)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device=inv.device) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return inv / factor * (1 - extrapolate) + inv * extrapolate, att


def rope_tables(head_dim: int, max_len: int, theta: float, device=None, a=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of RoFormer eq. (34): angle(pos, i) = pos * inv_freq_i, shape [max_len, D/2], with
    the args' rope scaling applied (`a`, see inv_frequencies)."""
    inv, att = inv_frequencies(head_dim, theta, a, device)
    ang = torch.outer(torch.arange(max_len, dtype=torch.float64, device=device), inv)
    return (ang.cos() * att).float(), (ang.sin() * att).float()


# [True] while the serving engine's static decode step runs (read when dynamo traces apply_rope, which
# guards on it: the step's graph and every other one are each traced with their own form)
REAL_FORM = [False]


def apply_rope(x_BLHD: torch.Tensor, cos_LD: torch.Tensor, sin_LD: torch.Tensor,
               positions_L: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate interleaved pairs (x0,x1),(x2,x3)... as Meta's complex-number RoPE does.

    positions: the absolute position of each of the L tokens (default 0..L-1), e.g. when the
    sequence is split across devices. Tables of shape [B, L, D/2] are already gathered at every
    row's own positions (generation: a batch of left-padded prompts, see Llama.forward).
    """
    B, L, H, D = x_BLHD.shape
    if cos_LD.dim() == 3:
        c, s = cos_LD.view(B, L, 1, D // 2), sin_LD.view(B, L, 1, D // 2)
    else:
        if positions_L is not None:
            cos_LD, sin_LD = cos_LD[positions_L], sin_LD[positions_L]
        c, s = cos_LD[:L].view(1, L, 1, D // 2), sin_LD[:L].view(1, L, 1, D // 2)
    if REAL_FORM[0] and torch.compiler.is_compiling():
        # The serving engine's static decode step (batching.static_decode sets REAL_FORM around it):
        # the real form, which inductor fuses into one kernel; it has no code for complex numbers, so
        # the complex multiply below runs as separate eager kernels inside the graph (a 16-layer decode
        # step on this CPU: 2.1 ms real, 4.2 ms complex). Every other forward, compiled or not, keeps
        # the complex form (training's compiled graphs and their parity tests unchanged).
        x0, x1 = x_BLHD.float().reshape(B, L, H, D // 2, 2).unbind(-1)
        c, s = c.float(), s.float()
        return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).reshape(B, L, H, D).type_as(x_BLHD)
    # One complex multiply per pair: the same products and sums as the real form written out
    # (equal to the bit, checked), 7x faster forward + backward on CPU than four strided real ones.
    x = torch.view_as_complex(x_BLHD.float().reshape(B, L, H, D // 2, 2))
    # (torch.complex takes no bf16: the tables go up to fp32 first, exactly, as the real form did)
    return torch.view_as_real(x * torch.complex(c.float(), s.float())).reshape(B, L, H, D).type_as(x_BLHD)
