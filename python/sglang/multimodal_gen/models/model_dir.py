"""Reading a diffusers-format model directory: its index, JSON configs and weight files.

Layout (what ``DiffusionPipeline.save_pretrained`` writes, e.g. ``Tongyi-MAI/Z-Image-Turbo``)::

    model_index.json                      {"_class_name": "ZImagePipeline", "<component>": [lib, cls]}
    transformer/config.json               {"_class_name": "ZImageTransformer2DModel", ...}
    transformer/diffusion_pytorch_model.safetensors            (one file), or
    transformer/diffusion_pytorch_model.safetensors.index.json + the shards it names
    text_encoder/  tokenizer/  vae/  scheduler/                 (their libraries' own formats)

This module only reads files (no torch, no family): the family registry
(:mod:`~sglang.multimodal_gen.models.registry`, which family serves ``model_index.json``'s
``_class_name``), our DiT loader (:mod:`~sglang.multimodal_gen.models.loader`) and the component
loader (:mod:`~sglang.multimodal_gen.models.components`) build on it. Errors name the file
(:class:`ModelLoadError`, ``FileNotFoundError``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

__all__ = [
    "DIFFUSERS_WEIGHT_STEMS",
    "MODEL_INDEX",
    "ModelIndex",
    "ModelLoadError",
    "find_weight_files",
    "read_json",
    "read_model_index",
]

MODEL_INDEX = "model_index.json"
# weight file stems: diffusers models, then transformers models
_WEIGHT_BASENAMES = ("diffusion_pytorch_model", "model")
#: the file names (``<stem>.safetensors`` or ``<stem>.safetensors.index.json``) of a diffusers or
#: transformers component's weights
DIFFUSERS_WEIGHT_STEMS = tuple(f"{b}.safetensors" for b in _WEIGHT_BASENAMES)


class ModelLoadError(ValueError):
    """A model directory cannot be loaded as given (the message names the file / tensor)."""


def read_json(path: str) -> dict:
    """Read a JSON object file.

    Raises:
        FileNotFoundError: no such file.
        ModelLoadError: invalid JSON, or not an object (named with the file).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"missing file: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


@dataclass
class ModelIndex:
    """Parsed ``model_index.json``.

    Attributes:
        path: the file's path (for messages).
        pipeline_class: its ``_class_name``.
        components: ``{name: (library, class_name)}`` of every present component (entries of
            ``[null, null]``, i.e. optional components left out, are dropped).
        config: the pipeline's own config values (e.g. Wan's ``boundary_ratio``,
            ``expand_timesteps``): every entry that is not a component or ``_`` metadata.
    """

    path: str
    pipeline_class: str
    components: dict[str, tuple[str, str]]
    config: dict = field(default_factory=dict)


def read_model_index(model_path: str) -> ModelIndex:
    """Read ``<model_path>/model_index.json``.

    Raises:
        FileNotFoundError: the directory or the file is missing.
        ModelLoadError: invalid JSON, no ``_class_name``, or a component entry that is not
            ``[library, class]`` (named with the file).
    """
    if not os.path.isdir(model_path):
        raise FileNotFoundError(f"model path is not a directory: {model_path}")
    path = os.path.join(model_path, MODEL_INDEX)
    data = read_json(path)
    cls = data.get("_class_name")
    if not isinstance(cls, str) or not cls:
        raise ModelLoadError(f"{path}: no pipeline _class_name")
    comps: dict[str, tuple[str, str]] = {}
    config: dict = {}
    for name, entry in data.items():
        if name.startswith("_"):
            continue
        if not isinstance(entry, list):
            config[name] = entry  # a pipeline config value (e.g. ``boundary_ratio``)
            continue
        if len(entry) != 2:
            raise ModelLoadError(f"{path}: component {name!r} is not [library, class]: {entry}")
        lib, ecls = entry
        if lib is None and ecls is None:
            continue
        if not (isinstance(lib, str) and isinstance(ecls, str)):
            raise ModelLoadError(f"{path}: component {name!r} is not [library, class]: {entry}")
        comps[name] = (lib, ecls)
    return ModelIndex(path, cls, comps, config)


def find_weight_files(component_dir: str) -> tuple[list[str], dict[str, str] | None]:
    """Locate a component's safetensors weights.

    Returns:
        ``(files, weight_map)``: the ``.safetensors`` files to read and, for a sharded checkpoint,
        ``{tensor_name: file}`` from its ``*.safetensors.index.json`` (else ``None``).

    Raises:
        FileNotFoundError: no safetensors weights, or a shard named by the index is missing.
        ModelLoadError: only pickle (``.bin``) weights (refused), or a malformed index.
    """
    if not os.path.isdir(component_dir):
        raise FileNotFoundError(f"missing component directory: {component_dir}")
    for base in _WEIGHT_BASENAMES:
        index = os.path.join(component_dir, f"{base}.safetensors.index.json")
        if os.path.isfile(index):
            data = read_json(index)
            wmap = data.get("weight_map")
            if not isinstance(wmap, dict) or not wmap:
                raise ModelLoadError(f"{index}: no 'weight_map'")
            files = sorted(set(wmap.values()))
            for f in files:
                if not os.path.isfile(os.path.join(component_dir, f)):
                    raise FileNotFoundError(
                        f"{index} names shard {f!r}, which is missing from {component_dir}"
                    )
            return [os.path.join(component_dir, f) for f in files], {
                k: os.path.join(component_dir, v) for k, v in wmap.items()
            }
        single = os.path.join(component_dir, f"{base}.safetensors")
        if os.path.isfile(single):
            return [single], None
    names = os.listdir(component_dir)
    if any(n.endswith((".bin", ".pt", ".pth", ".ckpt")) for n in names):
        raise ModelLoadError(
            f"{component_dir}: only pickle weights found; safetensors are required "
            "(pickle files can run code when loaded)"
        )
    raise FileNotFoundError(f"{component_dir}: no safetensors weights found")
