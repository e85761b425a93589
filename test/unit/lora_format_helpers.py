"""Shared builders for the LoRA format tests: a tiny diffusers Z-Image model and synthetic files.

The reference for every format is computed by hand from the random tensors written into the file:
the per-module delta ``(alpha / r) * B @ A`` in the diffusers module names (:func:`reference_deltas`).
The converted result is looked up through the hand-written table :data:`OUR_SLOTS` (diffusers module
-> our module and shard), never through the name map under test.
"""

from __future__ import annotations

import functools

import torch
from safetensors.torch import save_file
from sglang.multimodal_gen.lora import LoRAModelSpec
from sglang.multimodal_gen.models.dits.zimage_names import ZIMAGE_NAME_MAP

DIM = 64
RANK = 4


@functools.lru_cache(maxsize=1)
def tiny_zimage():
    """A tiny diffusers ``ZImageTransformer2DModel`` (dim 64, 4 heads, 2 layers, 1 refiner each)."""
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(0)
    return ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=4,
        dim=DIM,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=4,
        n_kv_heads=4,
        cap_feat_dim=32,
        axes_dims=[4, 6, 6],
        axes_lens=[32, 32, 32],
    ).eval()


def zimage_spec() -> LoRAModelSpec:
    return LoRAModelSpec.from_module(tiny_zimage(), ZIMAGE_NAME_MAP, "Z-Image")


def linear_shapes() -> dict[str, tuple[int, int]]:
    """``{diffusers module name: (out, in)}`` of every nn.Linear of the tiny model."""
    return {
        n: (m.out_features, m.in_features)
        for n, m in tiny_zimage().named_modules()
        if isinstance(m, torch.nn.Linear)
    }


def random_pairs(
    names, rank: int = RANK, seed: int = 0
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Random non-zero ``(A [r, in], B [out, r])`` per diffusers module name."""
    g = torch.Generator().manual_seed(seed)
    shapes = linear_shapes()
    out = {}
    for n in names:
        o, i = shapes[n]
        a = torch.randn(rank, i, generator=g) * 0.1
        b = torch.randn(o, rank, generator=g) * 0.1
        out[n] = (a, b)
    return out


def diffusers_sd(pairs, prefix: str = "transformer.") -> dict[str, torch.Tensor]:
    sd = {}
    for n, (a, b) in pairs.items():
        sd[f"{prefix}{n}.lora_A.weight"] = a
        sd[f"{prefix}{n}.lora_B.weight"] = b
    return sd


def reference_deltas(pairs, alphas=None) -> dict[str, torch.Tensor]:
    """``{diffusers name: (alpha / r) * B @ A}`` (alpha defaults to r)."""
    alphas = alphas or {}
    ref = {}
    for n, (a, b) in pairs.items():
        r = a.shape[0]
        ref[n] = (alphas.get(n, r) / r) * (b.double() @ a.double())
    return ref


# Where a diffusers Z-Image module lands in our DiT: (suffix, our suffix, shard id). Written out by
# hand from the architecture (q/k/v fused in ``to_qkv`` as sections "q"/"k"/"v"; the SwiGLU gate
# ``w1`` and up ``w3`` fused in ``w13`` as sections 0 and 1; every other linear kept as is), NOT
# derived from ZIMAGE_NAME_MAP: the expected values must not share a bug with the code under test.
OUR_SLOTS = (
    ("attention.to_q", "attention.to_qkv", "q"),
    ("attention.to_k", "attention.to_qkv", "k"),
    ("attention.to_v", "attention.to_qkv", "v"),
    ("feed_forward.w1", "feed_forward.w13", 0),
    ("feed_forward.w3", "feed_forward.w13", 1),
)


def our_slot(name: str) -> tuple[str, object]:
    """``(our module, shard id)`` of a diffusers module name, from the hand table above."""
    for src, dst, sid in OUR_SLOTS:
        if name.endswith("." + src):
            return name[: -len(src)] + dst, sid
    return name, None


def canonical_deltas(canon, names) -> dict[str, torch.Tensor]:
    """Per diffusers module name, the delta our canonical form holds for it, looked up in the
    module/shard given by the hand table :data:`OUR_SLOTS` (not by the name map under test)."""
    out = {}
    for n in names:
        our, sid = our_slot(n)
        assert our in canon.modules and sid in canon.modules[our], (n, our, sid)
        w = canon.modules[our][sid]
        out[n] = w.scale * (w.lora_B.double() @ w.lora_A.double())
    return out


def assert_deltas_equal(got: dict, ref: dict, atol: float = 1e-6) -> None:
    assert set(got) == set(ref), (sorted(set(got) ^ set(ref)))[:5]
    for n in ref:
        assert got[n].shape == ref[n].shape, n
        assert ref[n].abs().max() > 0, n
        torch.testing.assert_close(got[n], ref[n].to(got[n].dtype), atol=atol, rtol=1e-5, msg=n)


def diffusers_converted_deltas(path) -> dict[str, torch.Tensor]:
    """Deltas from diffusers' own Z-Image converter (``ZImagePipeline.lora_state_dict``).

    diffusers folds ``alpha / r`` into the converted weights, so the delta is ``B @ A``.
    """
    from diffusers import ZImagePipeline

    sd = ZImagePipeline.lora_state_dict(str(path))
    out = {}
    for k, a in sd.items():
        if k.endswith(".lora_A.weight"):
            n = k[len("transformer.") : -len(".lora_A.weight")]
            b = sd[k.replace(".lora_A.weight", ".lora_B.weight")]
            out[n] = b.double() @ a.double()
    return out


def save(tmp_path, name: str, sd: dict, metadata: dict | None = None):
    p = tmp_path / name
    save_file({k: v.contiguous() for k, v in sd.items()}, str(p), metadata=metadata)
    return p


def kohya_name(n: str) -> str:
    return "lora_unet_" + n.replace(".", "_")


# A representative module list: every kind of Z-Image LoRA target.
SAMPLE = [
    "layers.0.attention.to_q",
    "layers.0.attention.to_k",
    "layers.0.attention.to_v",
    "layers.0.attention.to_out.0",
    "layers.0.feed_forward.w1",
    "layers.0.feed_forward.w2",
    "layers.0.feed_forward.w3",
    "layers.0.adaLN_modulation.0",
    "layers.1.attention.to_q",
    "noise_refiner.0.attention.to_v",
    "context_refiner.0.feed_forward.w2",
    "all_x_embedder.2-1",
    "all_final_layer.2-1.linear",
    "t_embedder.mlp.0",
    "t_embedder.mlp.2",
    "cap_embedder.1",
]
