"""Wan2.2's two experts switch where diffusers switches: the high-noise expert runs while
``t >= boundary_ratio x num_train_timesteps`` (``WanPipeline.__call__``), so a step whose
timestep equals the boundary still runs ``transformer``."""

from __future__ import annotations

import torch
from sglang.multimodal_gen.pipelines.wan import WanPipeline


def test_a_timestep_at_the_boundary_runs_the_high_noise_expert(tiny_wan_a14b_dir):
    pipe = WanPipeline.from_pretrained(tiny_wan_a14b_dir)
    boundary = pipe._boundary()
    assert boundary is not None
    g = pipe.new_generation(pipe.spec.params(prompt="a boat", height=32, width=32, num_frames=5))
    high, low = pipe.transformer, pipe.denoisers["transformer_2"]
    assert pipe.select_denoiser(0, torch.tensor(float(boundary)), g) is high
    assert pipe.select_denoiser(0, torch.tensor(boundary + 1.0), g) is high
    assert pipe.select_denoiser(0, torch.tensor(boundary - 0.5), g) is low
