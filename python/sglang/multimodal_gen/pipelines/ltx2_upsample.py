"""LTX-2's latent upsampling stage: stage-1 video latents -> latents at twice the height and width,
the step between the two stages of LTX-2's two-stage recipe.

What it computes is what diffusers 0.42.1 ``LTX2LatentUpsamplePipeline.__call__``
(pipelines/ltx2/pipeline_ltx2_latent_upsample.py) computes for ``latents=...,
output_type="latent"``; the network is diffusers' own ``LTX2LatentUpsamplerModel``
(pipelines/ltx2/latent_upsampler.py), loaded from the model directory's ``latent_upsampler/``:

1. packed latents ``[B, S, D]`` are unpacked to ``[B, C, F, H, W]`` (token order ``(f, h, w)``,
   feature order ``(c, p_t, p, p)``, as diffusers' ``_unpack_latents``), then taken to float32;
2. normalized latents are un-normalized with the video VAE's statistics,
   ``x * latents_std / scaling_factor + latents_mean`` (per channel): the upsampler works on raw
   VAE latents;
3. ``y = upsampler(x.to(upsampler dtype))``;
4. optional AdaIN (``adain_factor > 0``; default 0: off): each ``(b, c)`` slice of ``y`` takes the
   mean and (unbiased) standard deviation of the same slice of ``x``, blended as
   ``lerp(y, adain(y), adain_factor)``;
5. optional tone mapping (``tone_map_compression_ratio`` in ``[0, 1]``; default 0: off):
   ``s = 0.75 r``, ``y * (1 - 0.8 s sigmoid(4 s (|y| - 1)))``.

diffusers returns the raw (un-normalized) result; :func:`upsample_video_latents` does too unless
``normalize_output=True``, which applies ``(y - latents_mean) * scaling_factor / latents_std``
(what ``LTX2Pipeline.prepare_latents`` does to 5-D latents before stage 2; Lightricks'
``VideoUpsampler`` likewise un-normalizes, upsamples and normalizes again).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["VideoLatentStats", "unpack_video_latents", "upsample_video_latents"]


@dataclass(frozen=True)
class VideoLatentStats:
    """The video VAE's per-channel latent statistics (``AutoencoderKLLTX2Video`` buffers
    ``latents_mean`` / ``latents_std``, float ``[C]``, and ``config.scaling_factor``)."""

    mean: torch.Tensor
    std: torch.Tensor
    scaling_factor: float = 1.0

    @classmethod
    def from_vae(cls, vae) -> VideoLatentStats:
        """The statistics of a loaded ``AutoencoderKLLTX2Video`` (detached copies)."""
        return cls(
            mean=vae.latents_mean.detach().clone(),
            std=vae.latents_std.detach().clone(),
            scaling_factor=float(vae.config.scaling_factor),
        )

    def _per_channel(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.ndim != 5 or x.shape[1] != self.mean.numel():
            raise ValueError(
                f"latents: expected [B, {self.mean.numel()}, F, H, W] video latents, got shape "
                f"{tuple(x.shape)}"
            )
        mean = self.mean.view(1, -1, 1, 1, 1).to(x.device, x.dtype)
        std = self.std.view(1, -1, 1, 1, 1).to(x.device, x.dtype)
        return mean, std

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, C, F, H, W]`` normalized -> raw VAE latents, in ``x``'s dtype."""
        mean, std = self._per_channel(x)
        return x * std / self.scaling_factor + mean

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, C, F, H, W]`` raw VAE latents -> normalized, in ``x``'s dtype."""
        mean, std = self._per_channel(x)
        return (x - mean) * self.scaling_factor / std


def unpack_video_latents(
    latents: torch.Tensor,
    grid: tuple[int, int, int],
    patch_size: int = 1,
    patch_size_t: int = 1,
) -> torch.Tensor:
    """Packed video tokens ``[B, S, D]`` -> ``[B, C, F, H, W]`` (diffusers' ``_unpack_latents``).

    Args:
        latents: ``[B, S, D]`` with ``S = (F/p_t)(H/p)(W/p)`` tokens in ``(f, h, w)`` order and
            ``D = C p_t p p`` features in ``(c, p_t, p_h, p_w)`` order.
        grid: the latent grid ``(F, H, W)`` after patching, ``(F/p_t, H/p, W/p)``.
        patch_size: spatial patch size ``p`` (LTX-2: 1).
        patch_size_t: temporal patch size ``p_t`` (LTX-2: 1).

    Raises:
        ValueError: naming ``latents`` when the shape does not fit the grid.
    """
    if latents.ndim != 3:
        raise ValueError(
            f"latents: packed latents must be [B, S, D], got shape {tuple(latents.shape)}"
        )
    f, h, w = grid
    b, s, d = latents.shape
    if s != f * h * w or d % (patch_size_t * patch_size * patch_size):
        raise ValueError(
            f"latents: shape {tuple(latents.shape)} does not fit the grid {grid} with patch sizes "
            f"({patch_size_t}, {patch_size}, {patch_size})"
        )
    x = latents.reshape(b, f, h, w, -1, patch_size_t, patch_size, patch_size)
    # [b, f, h, w, c, pt, ph, pw] -> [b, c, f, pt, h, ph, w, pw] -> [b, c, f*pt, h*ph, w*pw]
    x = x.permute(0, 4, 1, 5, 2, 6, 3, 7)
    return x.reshape(b, x.shape[1], f * patch_size_t, h * patch_size, w * patch_size)


def _adain(y: torch.Tensor, ref: torch.Tensor, factor: float) -> torch.Tensor:
    dims = (2, 3, 4)
    r_sd, r_mean = torch.std_mean(ref, dim=dims, keepdim=True)
    i_sd, i_mean = torch.std_mean(y, dim=dims, keepdim=True)
    return torch.lerp(y, (y - i_mean) / i_sd * r_sd + r_mean, factor)


def _tone_map(y: torch.Tensor, compression: float) -> torch.Tensor:
    s = compression * 0.75
    return y * (1.0 - 0.8 * s * torch.sigmoid(4.0 * s * (torch.abs(y) - 1.0)))


@torch.no_grad()
def upsample_video_latents(
    latents: torch.Tensor,
    upsampler: torch.nn.Module,
    stats: VideoLatentStats,
    *,
    latents_normalized: bool,
    grid: tuple[int, int, int] | None = None,
    patch_size: int = 1,
    patch_size_t: int = 1,
    adain_factor: float = 0.0,
    tone_map_compression_ratio: float = 0.0,
    normalize_output: bool = False,
) -> torch.Tensor:
    """Stage-1 video latents -> x2 upsampled latents (module docstring, steps 1-5).

    Args:
        latents: ``[B, C, F, H, W]`` video latents, or packed tokens ``[B, S, D]`` (then ``grid``
            is required); any float dtype, on the upsampler's device.
        upsampler: diffusers' ``LTX2LatentUpsamplerModel`` (its ``dtype`` is the compute dtype).
        stats: the video VAE's latent statistics.
        latents_normalized: whether ``latents`` are normalized by ``stats`` (our pipeline's
            packed latents are; diffusers' ``LTX2Pipeline(output_type="latent")`` returns raw).
        grid: ``(F, H, W)`` of packed latents (after patching).
        patch_size, patch_size_t: the transformer's patch sizes (LTX-2: 1, 1).
        adain_factor: AdaIN blend in ``[-10, 10]``; 0 (diffusers' default) leaves it out.
        tone_map_compression_ratio: in ``[0, 1]``; 0 (diffusers' default) leaves it out.
        normalize_output: return normalized latents instead of raw ones.

    Returns:
        ``[B, C, F, 2H, 2W]`` (spatial x2 upsampler) in the upsampler's dtype: raw VAE latents,
        or normalized ones with ``normalize_output``.

    Raises:
        ValueError: naming the field: a packed tensor without ``grid``, a shape that fits no
            video latent, ``tone_map_compression_ratio`` outside ``[0, 1]``, ``adain_factor``
            outside ``[-10, 10]``.
    """
    if not 0.0 <= tone_map_compression_ratio <= 1.0:
        raise ValueError(
            f"tone_map_compression_ratio: must lie in [0, 1], got {tone_map_compression_ratio}"
        )
    if not -10.0 <= adain_factor <= 10.0:
        raise ValueError(f"adain_factor: must lie in [-10, 10], got {adain_factor}")
    if latents.ndim == 3:
        if grid is None:
            raise ValueError("grid: packed latents [B, S, D] need their latent grid (F, H, W)")
        latents = unpack_video_latents(latents, grid, patch_size, patch_size_t)
    elif latents.ndim != 5:
        raise ValueError(
            f"latents: expected [B, C, F, H, W] or packed [B, S, D], got shape {tuple(latents.shape)}"
        )
    x = latents.to(torch.float32)
    if latents_normalized:
        x = stats.denormalize(x)
    x = x.to(upsampler.dtype)
    y = upsampler(x)
    if adain_factor > 0.0:
        y = _adain(y, x, adain_factor)
    if tone_map_compression_ratio > 0.0:
        y = _tone_map(y, tone_map_compression_ratio)
    return stats.normalize(y) if normalize_output else y
