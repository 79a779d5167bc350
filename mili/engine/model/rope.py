"""Rotary position embeddings (RoPE) for Qwen3: plain RoPE and HF's YaRN scaling.

Qwen3 rotates the two halves of each head (`rotate_half`, not interleaved pairs), exactly as HF
transformers does; we match it operation for operation so fp32 logits agree to ~1e-6.

cos/sin come from a table of every position the model accepts (`max_context_tokens`),
built once per device when the model loads: computing them per step from the positions took
about eight kernels per step (cast, multiply, cat, cos, sin, two scalings, casts), and a table
row is all a fused RoPE kernel needs to read. Its size is max_context_tokens x head_dim
float32 values: 21 MB for Qwen3's 40960 positions of 128 (67 MB with YaRN's 131072).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mili.engine.model.config import ConfigError, Qwen3Config


def rope_parameters(config: Qwen3Config) -> tuple[torch.Tensor, float]:
    """(inv_freq `[head_dim // 2]` float32 on CPU, attention_scaling) for the config's RoPE.

    `attention_scaling` multiplies cos and sin (YaRN's "mscale"); it is 1.0 for plain RoPE.
    """
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    dim = config.head_dim
    # Explicit device: models are built under `torch.device("meta")` by the loader, and these
    # frequencies are not checkpoint weights, so they must be real numbers from the start.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    if rope_type == "default":
        return 1.0 / (config.rope_theta**exponents), 1.0
    if rope_type == "yarn":
        return _yarn(config, scaling, exponents)
    raise ConfigError(
        f"config field 'rope_scaling' has rope_type {rope_type!r}; supported: 'default', 'yarn'"
    )


def _yarn(
    config: Qwen3Config, scaling: dict[str, Any], exponents: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as `transformers.modeling_rope_utils._compute_yarn_parameters`.

    Low-frequency dimensions (long wavelengths, which never completed a rotation during
    pre-training) are interpolated by `factor`; high-frequency ones are left as they were; a linear
    ramp between the `beta_fast` and `beta_slow` rotation counts blends the two.
    """
    base = config.rope_theta
    dim = config.head_dim
    original_max = scaling.get("original_max_position_embeddings") or config.max_position_embeddings
    factor = scaling.get("factor")
    if factor is None:
        factor = config.max_position_embeddings / original_max
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        else:
            attention_factor = _mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength fits `num_rotations` times into the original context.
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp

    pos_freqs = base**exponents
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    ramp_x = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = torch.clamp((ramp_x - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_weight)
        + inv_freq_extrapolation * extrapolation_weight
    )
    return inv_freq, float(attention_factor)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RotaryEmbedding:
    """Holds inv_freq (float32, never cast with the weights) and the cos/sin table built from it."""

    def __init__(self, config: Qwen3Config) -> None:
        self.inv_freq, self.attention_scaling = rope_parameters(config)
        self.num_positions = config.max_context_tokens
        self._table: torch.Tensor | None = None

    def cos_sin_table(self, device: torch.device | str) -> torch.Tensor:
        """[max_context_tokens, head_dim] float32 on `device`: row p holds cos(p * inv_freq)
        in [:D/2] and sin(p * inv_freq) in [D/2:], both times attention_scaling.

        Built on first use per device (the loader asks once at load) and kept: afterwards a
        call is a device comparison, no work and no allocation (CUDA graph capture safe).
        """
        device = torch.device(device)
        if self._table is None or self._table.device != device:
            inv_freq = self.inv_freq.to(device)
            positions = torch.arange(self.num_positions, dtype=torch.int64, device=device)
            # The products HF forms (float32 positions x inv_freq), then its cos/sin and scaling.
            freqs = positions[:, None].float() * inv_freq[None, :]  # [P, D/2]
            self._table = torch.cat(
                (freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling),
                dim=-1,
            )
        return self._table


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D], cos/sin: [T, D/2] in x's dtype -> x rotated, [T, heads, D].

    HF's `x * cos + rotate_half(x) * sin` with rotate_half(x) = cat(-x2, x1), half by half:
    (-x2) * sin + x1 * cos is x1 * cos - x2 * sin bit for bit, so this is the same arithmetic.
    """
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
