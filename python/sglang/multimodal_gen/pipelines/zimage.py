"""Z-Image text-to-image pipeline: prompt encoding -> flow-matching denoising -> VAE decode.

Follows diffusers' ``ZImagePipeline.__call__`` (diffusers 0.42.1,
``pipelines/z_image/pipeline_z_image.py``) step for step, so that the same weights and seed give
the same image:

* prompt: chat template (one user message, generation prompt, ``enable_thinking=True``), tokenized
  padded to ``max_sequence_length`` (512), text encoder ``hidden_states[-2]``, keeping the
  attention-masked tokens of each prompt;
* CFG is on when ``guidance_scale > 0``; the negative prompt defaults to ``""``; the prediction is
  ``pos + g * (pos - neg)`` (optionally norm-capped), and guidance is switched off on steps whose
  ``t_norm = (1000 - t) / 1000`` exceeds ``cfg_truncation``;
* latents ``[B, C, 2 * (H // 16), 2 * (W // 16)]`` fp32 drawn with ``torch.randn`` from the
  caller's generator (on the generator's device, moved to the execution device) — diffusers'
  ``randn_tensor``;
* schedule: sigmas ``linspace(1, 1/n, n)`` passed to the diffusers ``FlowMatchEulerDiscreteScheduler``
  with ``mu`` from the image token count (linear between (256, 0.5) and (4096, 1.15), read from
  the scheduler config); the transformer sees ``t = (1000 - timestep) / 1000`` and its output is
  negated before the Euler step;
* decode: ``latents / scaling_factor + shift_factor`` -> ``AutoencoderKL.decode`` -> ``[-1, 1]``
  -> ``round(255 * clamp(x / 2 + 0.5, 0, 1))`` uint8.

The caption side of the DiT (embedding + context refiner) does not depend on the timestep, so it
is computed once per call instead of once per step (same numbers).

Under tensor parallelism every rank runs this same code on the same inputs (the engine broadcasts
requests); only ranks with a VAE (rank 0) decode.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm

from sglang.multimodal_gen.models.dits.zimage import ZImageTransformer


def calculate_shift(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """Resolution-dependent shift ``mu``: the line through ``(base_seq_len, base_shift)`` and
    ``(max_seq_len, max_shift)`` evaluated at ``image_seq_len`` (image tokens after patching)."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * slope + (base_shift - slope * base_seq_len)


def default_sigmas(num_inference_steps: int) -> list[float]:
    """Z-Image's unshifted sigmas: ``n`` points evenly from 1 down to ``1/n`` (fp32 linspace)."""
    return torch.linspace(1.0, 1.0 / num_inference_steps, num_inference_steps).tolist()


def randn_latents(
    shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """fp32 standard normal ``shape`` drawn on the generator's device, then moved to ``device``
    (a CPU generator with a CUDA device draws on the CPU, as diffusers' ``randn_tensor``)."""
    rand_device = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=rand_device, dtype=torch.float32).to(
        device
    )


def latents_to_uint8(images: torch.Tensor) -> np.ndarray:
    """``[B, 3, H, W]`` in ``[-1, 1]`` -> ``[B, H, W, 3]`` uint8 (round half to even)."""
    x = (images.float() / 2 + 0.5).clamp(0, 1)
    x = x.permute(0, 2, 3, 1).cpu().numpy()
    return (x * 255).round().astype("uint8")


@dataclass
class ZImageComponents:
    """The loaded parts of a Z-Image pipeline (``vae`` may be ``None`` on TP ranks > 0)."""

    transformer: ZImageTransformer
    text_encoder: torch.nn.Module
    tokenizer: object
    vae: torch.nn.Module | None
    scheduler_config: dict
    vae_scale_factor: int | None = None  # needed when ``vae`` is None (TP ranks > 0)


class ZImagePipeline:
    """Text-to-image with our Z-Image DiT and the reference text encoder / VAE / scheduler.

    Args:
        components: see :class:`ZImageComponents`.
        device: execution device.

    Attributes:
        vae_scale_factor: ``2 ** (len(vae.block_out_channels) - 1)`` (8 for Z-Image).
        spatial_factor: ``vae_scale_factor * 2``; height and width must be multiples of it.
    """

    def __init__(self, components: ZImageComponents, device: torch.device | str = "cpu"):
        self.transformer = components.transformer
        self.text_encoder = components.text_encoder
        self.tokenizer = components.tokenizer
        self.vae = components.vae
        self.scheduler_config = dict(components.scheduler_config)
        self.device = torch.device(device)
        if self.vae is not None:
            self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        else:
            self.vae_scale_factor = components.vae_scale_factor or 8
        self.spatial_factor = self.vae_scale_factor * 2

    @classmethod
    def from_pretrained(
        cls,
        model_path: str,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        load_vae: bool = True,
    ) -> ZImagePipeline:
        """Load a diffusers-format Z-Image directory (see ``models.loader``).

        Raises:
            FileNotFoundError / ValueError: see ``models.loader`` (messages name file and tensor).
        """
        import os

        from sglang.multimodal_gen.models import loader

        loader.read_model_index(model_path)
        j = lambda name: os.path.join(model_path, name)  # noqa: E731
        transformer = loader.load_zimage_transformer(
            j("transformer"), dtype=dtype, device=device, tp_rank=tp_rank, tp_size=tp_size
        )
        sched = loader.load_scheduler_config(j("scheduler"))
        vae = loader.load_vae(j("vae"), dtype, device) if load_vae else None
        vcfg = loader.read_json(os.path.join(j("vae"), "config.json"))
        comps = ZImageComponents(
            transformer=transformer,
            text_encoder=loader.load_text_encoder(j("text_encoder"), dtype, device),
            tokenizer=loader.load_tokenizer(j("tokenizer")),
            vae=vae,
            scheduler_config=sched,
            vae_scale_factor=2 ** (len(vcfg.get("block_out_channels", [0] * 4)) - 1),
        )
        return cls(comps, device=device)

    # ------------------------------------------------------------------ text
    @torch.no_grad()
    def encode_prompt(
        self, prompts: list[str], max_sequence_length: int = 512
    ) -> list[torch.Tensor]:
        """Encode prompts as the reference does.

        Args:
            prompts: ``B`` strings.
            max_sequence_length: tokenizer padding/truncation length.

        Returns:
            ``B`` tensors ``[L_i, hidden]`` in the text encoder's dtype (the second-to-last hidden
            layer at the prompt's unmasked tokens).
        """
        texts = [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}],
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=True,
            )
            for p in prompts
        ]
        enc = self.tokenizer(
            texts,
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            return_tensors="pt",
        )
        ids = enc.input_ids.to(self.device)
        mask = enc.attention_mask.to(self.device).bool()
        hidden = self.text_encoder(
            input_ids=ids, attention_mask=mask, output_hidden_states=True
        ).hidden_states[-2]
        return [hidden[i][mask[i]] for i in range(len(prompts))]

    # ------------------------------------------------------------------ main
    def latent_shape(self, batch: int, height: int, width: int) -> tuple[int, int, int, int]:
        s = self.vae_scale_factor * 2
        return (batch, self.transformer.cfg.in_channels, 2 * (height // s), 2 * (width // s))

    def check_size(self, height: int, width: int) -> None:
        """Raises ``ValueError`` when ``height``/``width`` are not positive multiples of
        :attr:`spatial_factor`."""
        s = self.spatial_factor
        for name, v in (("height", height), ("width", width)):
            if v <= 0 or v % s:
                raise ValueError(f"{name} must be a positive multiple of {s}, got {v}")

    @torch.no_grad()
    def __call__(
        self,
        prompt: str,
        negative_prompt: str | None = None,
        height: int = 1024,
        width: int = 1024,
        num_inference_steps: int = 8,
        guidance_scale: float = 0.0,
        generator: torch.Generator | None = None,
        num_images: int = 1,
        cfg_normalization: float = 0.0,
        cfg_truncation: float = 1.0,
        max_sequence_length: int = 512,
        output_type: str = "pil",
        progress: bool | None = None,
        step_callback: Callable[[int, float], None] | None = None,
    ):
        """Generate ``num_images`` images for one prompt.

        Args:
            prompt, negative_prompt: text (negative used only with guidance; default ``""``).
            height, width: pixels, multiples of :attr:`spatial_factor`.
            num_inference_steps: denoising steps (>= 1).
            guidance_scale: CFG weight ``g``; ``0`` disables CFG (one DiT pass per step).
            generator: seeds the initial latents.
            num_images: images per prompt (one ``randn`` of batch ``num_images``).
            cfg_normalization: if > 0, cap ``||pred|| <= cfg_normalization * ||pos||``.
            cfg_truncation: disable guidance on steps with ``(1000 - t) / 1000 > cfg_truncation``.
            max_sequence_length: tokenizer length.
            output_type: ``"pil"`` (list of PIL images), ``"np"`` (uint8 ``[B, H, W, 3]``) or
                ``"latent"`` (fp32 ``[B, C, h, w]``). Without a VAE (TP ranks > 0) ``None`` is
                returned for the image types.
            progress: show a tqdm bar over steps (default: when stderr is a terminal).
            step_callback: called as ``step_callback(step_index, seconds)`` after each step.

        Raises:
            ValueError: bad size, step count or output type.
        """
        import time

        self.check_size(height, width)
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        if num_images < 1:
            raise ValueError(f"num_images must be >= 1, got {num_images}")
        if output_type not in ("pil", "np", "latent"):
            raise ValueError(f"output_type must be 'pil', 'np' or 'latent', got {output_type!r}")
        from diffusers import FlowMatchEulerDiscreteScheduler

        do_cfg = guidance_scale > 0
        prompts = [prompt]
        if do_cfg:
            prompts.append(negative_prompt if negative_prompt is not None else "")
        embeds = self.encode_prompt(prompts, max_sequence_length)
        pos_embeds = [embeds[0]] * num_images
        neg_embeds = [embeds[1]] * num_images if do_cfg else []

        dit = self.transformer
        latents = randn_latents(
            self.latent_shape(num_images, height, width), generator, self.device
        )
        image_seq_len = (latents.shape[2] // 2) * (latents.shape[3] // 2)
        sc = self.scheduler_config
        mu = calculate_shift(
            image_seq_len,
            sc.get("base_image_seq_len", 256),
            sc.get("max_image_seq_len", 4096),
            sc.get("base_shift", 0.5),
            sc.get("max_shift", 1.15),
        )
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(sc)
        scheduler.set_timesteps(
            sigmas=default_sigmas(num_inference_steps), device=self.device, mu=mu
        )
        timesteps = scheduler.timesteps
        scheduler.set_begin_index(0)
        t_norms = ((1000 - timesteps.float()) / 1000).tolist() if do_cfg else None

        # caption side once per call: [pos x n, neg x n] (CFG) and pos x n
        ctx_full = dit.encode_captions(pos_embeds + neg_embeds)
        ctx_pos = ctx_full.select(list(range(num_images))) if do_cfg else ctx_full

        show = sys.stderr.isatty() if progress is None else progress
        for i, t in enumerate(tqdm(timesteps, disable=not show, desc="denoise")):
            t0 = time.perf_counter()
            tt = (1000 - t.expand(latents.shape[0])) / 1000
            g = guidance_scale
            if t_norms is not None and t_norms[i] > cfg_truncation:
                g = 0.0
            apply_cfg = do_cfg and g > 0
            lat = latents.to(dit.dtype).unsqueeze(2)
            if apply_cfg:
                out = dit(lat.repeat(2, 1, 1, 1, 1), tt.repeat(2), ctx_full)
                pos = torch.stack(out[:num_images]).float()
                neg = torch.stack(out[num_images:]).float()
                pred = pos + g * (pos - neg)
                if cfg_normalization and float(cfg_normalization) > 0:
                    for j in range(num_images):
                        pn = torch.linalg.vector_norm(pos[j])
                        nn_ = torch.linalg.vector_norm(pred[j])
                        cap = pn * float(cfg_normalization)
                        if nn_ > cap:
                            pred[j] = pred[j] * (cap / nn_)
            else:
                pred = torch.stack(dit(lat, tt, ctx_pos)).float()
            velocity = -pred.squeeze(2)
            latents = scheduler.step(velocity, t, latents, return_dict=False)[0]
            if step_callback is not None:
                step_callback(i, time.perf_counter() - t0)

        if output_type == "latent":
            return latents
        if self.vae is None:
            return None
        shift = self.vae.config.shift_factor or 0.0
        z = latents.to(self.vae.dtype) / self.vae.config.scaling_factor + shift
        images = latents_to_uint8(self.vae.decode(z, return_dict=False)[0])
        if output_type == "np":
            return images
        return [Image.fromarray(a) for a in images]
