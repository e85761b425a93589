"""Small, seeded, random-weight Qwen-Image-Edit and Qwen-Image-Edit-Plus directories in diffusers
format (tests, demos).

The DiT, VAE and scheduler are the tiny Qwen-Image ones (``models/families/tiny/qwen_image.py``);
the text encoder is a ``Qwen2_5_VLForConditionalGeneration`` with a tiny vision tower whose token
ids are those of the byte-level tokenizer extended with Qwen2.5-VL's vision tokens
(``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``); the ``processor``
is a ``Qwen2VLProcessor`` of that tokenizer and transformers' PIL image processor
(``Qwen2VLImageProcessorPil``, saved under its ``Qwen2VLImageProcessor`` type as real checkpoints
are), capped at 112x112 pixels so that the vision tower stays cheap. The processor folder is
written part by part (tokenizer, ``preprocessor_config.json``): without torchvision transformers
can neither build nor save a ``Qwen2VLProcessor`` (its video processor does not import); load it
with :func:`sglang.multimodal_gen.models.processors.load_processor`. Random weights: images are
noise by construction.

``build_qwen_image_edit_plus_dir(..., zero_cond_t=True)`` writes a Qwen-Image-Edit-2511-style
directory: the same weights, with ``"zero_cond_t": true`` in ``transformer/config.json`` (the
condition images' tokens are modulated with timestep 0).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from sglang.multimodal_gen.models.families.tiny.common import (
    build_byte_level_chat_tokenizer,
    redraw_constant_params,
)
from sglang.multimodal_gen.models.families.tiny.qwen_image import build_qwen_image_components

TINY_VERSION = "2"
DEFAULT_SEED = 1234
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# the vision tower sees at most 112x112 pixels (16 merged tokens) per image
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112
# the pixel areas the tiny models resize input images to (real models: 1024^2 for the VAE, 384^2
# for Plus's vision encoder), written to model_index.json as ``sglang_image_areas``
TINY_AREAS = {"vae": 64 * 64, "condition": 56 * 56}
DIT_SCALES = ((r"attn\.to_out", 8.0), (r"^proj_out", 4.0), (r"_mod\.", 5.0))


def build_vl_tokenizer():
    """The byte-level chat tokenizer plus Qwen2.5-VL's four vision tokens (ids 259..262), and the
    edit template's system sentence as 48 added tokens, so that the template up to the user's
    content is 64 tokens as with Qwen's tokenizer (the pipelines drop those 64; byte by byte the
    sentence would be ~300 tokens that drown the image and the instruction)."""
    from sglang.multimodal_gen.pipelines.qwen_image_edit import SYSTEM, TEMPLATE_TOKENS

    tok = build_byte_level_chat_tokenizer()
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *VISION_TOKENS]}
    )
    head, tail = "<|im_start|>system\n", "<|im_end|>\n"
    sentence = SYSTEM[len(head) : -len(tail)]
    n = 48
    bounds = [round(i * len(sentence) / n) for i in range(n + 1)]
    tok.add_tokens([sentence[a:b] for a, b in zip(bounds, bounds[1:])])
    prefix = SYSTEM + "<|im_start|>user\n"
    assert len(tok(prefix).input_ids) == TEMPLATE_TOKENS, len(tok(prefix).input_ids)
    return tok


def build_qwen_image_edit_components(
    seed: int = DEFAULT_SEED, *, zero_cond_t: bool = False
) -> dict[str, Any]:
    """The six components of a ``QwenImageEditPipeline`` / ``QwenImageEditPlusPipeline`` (fp32,
    CPU, eval mode); ``processor`` is a ``Qwen2VLProcessor`` built without its video part.
    ``zero_cond_t``: the transformer is the same weights in a ``zero_cond_t=True``
    ``QwenImageTransformer2DModel`` (Qwen-Image-Edit-2511)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from sglang.multimodal_gen.models.processors import tolerant_processor_class

    comps = build_qwen_image_components(seed)
    if zero_cond_t:
        from diffusers import QwenImageTransformer2DModel

        dit = comps["transformer"]
        init = {k: v for k, v in dit.config.items() if not k.startswith("_")}
        comps["transformer"] = QwenImageTransformer2DModel(**dict(init, zero_cond_t=True)).eval()
        comps["transformer"].load_state_dict(dit.state_dict())
    tok = build_vl_tokenizer()
    ids = dict(zip(("start", "end", "image", "video"), tok.convert_tokens_to_ids(VISION_TOKENS)))
    gen = torch.Generator().manual_seed(seed + 10)
    torch.manual_seed(seed + 10)
    te_cfg = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
            bos_token_id=tok.pad_token_id, eos_token_id=tok.pad_token_id,
            rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
        ),
        vision_config=dict(
            depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
            patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
            fullatt_block_indexes=[1],
        ),
        image_token_id=ids["image"], video_token_id=ids["video"],
        vision_start_token_id=ids["start"], vision_end_token_id=ids["end"],
    )  # fmt: skip
    te = Qwen2_5_VLForConditionalGeneration(te_cfg).eval()
    redraw_constant_params(te, gen, 0.1)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    processor = tolerant_processor_class(Qwen2VLProcessor)(
        image_processor=image_processor, tokenizer=tok
    )
    # louder attention outputs, modulations and output projection than the Qwen-Image tiny DiT's
    # (the same seeded weights, scaled): at 2 steps the images and the instruction then move the
    # output well outside the parity threshold instead of a level or two
    with torch.no_grad():
        for name, p in comps["transformer"].named_parameters():
            for pattern, scale in DIT_SCALES:
                if re.search(pattern, name):
                    p.mul_(scale)
    comps.update(text_encoder=te, tokenizer=tok, processor=processor)
    return comps


def _save(path: str, pipeline_class: str, seed: int, zero_cond_t: bool = False) -> str:
    import diffusers

    comps = build_qwen_image_edit_components(seed, zero_cond_t=zero_cond_t)
    processor = comps.pop("processor")
    pipe = getattr(diffusers, pipeline_class)(**comps, processor=None)
    pipe.save_pretrained(path, safe_serialization=True)
    folder = os.path.join(path, "processor")
    processor.image_processor.save_pretrained(folder)
    processor.tokenizer.save_pretrained(folder)
    index_path = os.path.join(path, "model_index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index["sglang_image_areas"] = dict(TINY_AREAS)
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    return path


def build_qwen_image_edit_dir(path: str | os.PathLike, *, seed: int = DEFAULT_SEED) -> str:
    """Write a diffusers-format Qwen-Image-Edit (``QwenImageEditPipeline``) directory at
    ``path``; returns ``str(path)``."""
    return _save(os.fspath(path), "QwenImageEditPipeline", seed)


def build_qwen_image_edit_plus_dir(
    path: str | os.PathLike, *, seed: int = DEFAULT_SEED, zero_cond_t: bool = False
) -> str:
    """Write a diffusers-format Qwen-Image-Edit-Plus (``QwenImageEditPlusPipeline``) directory at
    ``path``: 2509-style, or 2511-style with ``zero_cond_t=True``; returns ``str(path)``."""
    return _save(os.fspath(path), "QwenImageEditPlusPipeline", seed, zero_cond_t)


def reference_pipeline(model_dir: str, **kwargs: Any):
    """diffusers' own pipeline of a tiny edit directory, as the tests' reference: loaded with
    ``DiffusionPipeline.from_pretrained`` and the processor from
    :func:`~sglang.multimodal_gen.models.processors.load_processor` (transformers cannot load a
    ``Qwen2VLProcessor`` without torchvision); while it runs, its module's
    ``calculate_dimensions`` maps the 1024^2 (VAE) and 384^2 (vision) areas to the directory's
    ``sglang_image_areas``, as our pipeline reads them. Everything else is diffusers' code."""
    import functools
    import importlib

    from diffusers import DiffusionPipeline
    from transformers import Qwen2VLProcessor

    from sglang.multimodal_gen.models.model_dir import read_json
    from sglang.multimodal_gen.models.processors import load_processor

    index = read_json(os.path.join(model_dir, "model_index.json"))
    areas = index.get("sglang_image_areas") or {}
    processor = load_processor(os.path.join(model_dir, "processor"), Qwen2VLProcessor)
    pipe = DiffusionPipeline.from_pretrained(model_dir, processor=processor, **kwargs)
    module = importlib.import_module(type(pipe).__module__)
    original = module.calculate_dimensions
    swap = {1024 * 1024: areas.get("vae"), 384 * 384: areas.get("condition")}

    def scaled(target_area, ratio):
        return original(swap.get(target_area) or target_area, ratio)

    base_call = type(pipe).__call__

    @functools.wraps(base_call)
    def call(self, *args, **kw):
        module.calculate_dimensions = scaled
        try:
            return base_call(self, *args, **kw)
        finally:
            module.calculate_dimensions = original

    pipe.__class__ = type(type(pipe).__name__, (type(pipe),), {"__call__": call})
    return pipe


build_qwen_image_edit_dir.version = TINY_VERSION  # cache key of an embedded default model
build_qwen_image_edit_plus_dir.version = TINY_VERSION
