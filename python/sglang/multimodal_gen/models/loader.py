"""Loading a diffusers-format model directory.

Layout (what ``DiffusionPipeline.save_pretrained`` writes, e.g. ``Tongyi-MAI/Z-Image-Turbo``)::

    model_index.json                      {"_class_name": "ZImagePipeline", "<component>": [lib, cls]}
    transformer/config.json               {"_class_name": "ZImageTransformer2DModel", ...}
    transformer/diffusion_pytorch_model.safetensors            (one file), or
    transformer/diffusion_pytorch_model.safetensors.index.json + the shards it names
    text_encoder/  tokenizer/  vae/  scheduler/                 (their libraries' own formats)

The transformer is built from OUR layers and filled through each parameter's ``weight_loader``.
Checkpoint names go through the model's name map (``models/dits/zimage_names.py``, shared with
LoRA loading), so ``attention.to_q`` lands in shard ``"q"`` of ``attention.to_qkv``. Tensors are
opened lazily (``safetensors.safe_open(...).get_slice``): a TP rank reads only the rows/columns
of its shard, so its peak host memory is about its shard plus one replicated tensor.

The text encoder, tokenizer, VAE and scheduler are loaded with transformers'/diffusers' own
classes. Errors name the file and the tensor (``ValueError``/``FileNotFoundError``).
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from sglang.multimodal_gen.configs.zimage import ZIMAGE_TRANSFORMER_CLASS, ZImageArchConfig
from sglang.multimodal_gen.models.dits.zimage import ZImageTransformer
from sglang.multimodal_gen.models.dits.zimage_names import ZIMAGE_NAME_MAP
from sglang.multimodal_gen.models.name_map import NameMap

logger = logging.getLogger(__name__)

MODEL_INDEX = "model_index.json"

# Pipelines we can serve, and the component classes each accepts.
SUPPORTED_PIPELINES: dict[str, dict[str, tuple[str, set[str]]]] = {
    "ZImagePipeline": {
        "transformer": ("diffusers", {ZIMAGE_TRANSFORMER_CLASS}),
        "vae": ("diffusers", {"AutoencoderKL"}),
        "scheduler": ("diffusers", {"FlowMatchEulerDiscreteScheduler"}),
        "text_encoder": ("transformers", {"Qwen3Model"}),
        "tokenizer": (
            "transformers",
            {"Qwen2Tokenizer", "Qwen2TokenizerFast", "PreTrainedTokenizerFast", "AutoTokenizer"},
        ),
    },
}

_WEIGHT_BASENAMES = ("diffusion_pytorch_model", "model")


class ModelLoadError(ValueError):
    """A model directory cannot be loaded as given (the message names the file / tensor)."""


def read_json(path: str) -> dict:
    """Read a JSON object file; errors name the file."""
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
    """Parsed ``model_index.json``: the pipeline class and ``{component: (library, class)}``."""

    path: str
    pipeline_class: str
    components: dict[str, tuple[str, str]]


def read_model_index(model_path: str) -> ModelIndex:
    """Read and validate ``<model_path>/model_index.json``.

    Raises:
        FileNotFoundError: the directory or ``model_index.json`` is missing.
        ModelLoadError: unknown pipeline ``_class_name``, a missing component, or a component
            class/library we do not support (named with the file).
    """
    if not os.path.isdir(model_path):
        raise FileNotFoundError(f"model path is not a directory: {model_path}")
    path = os.path.join(model_path, MODEL_INDEX)
    data = read_json(path)
    cls = data.get("_class_name")
    if cls not in SUPPORTED_PIPELINES:
        raise ModelLoadError(
            f"{path}: unknown pipeline _class_name {cls!r}; supported: {sorted(SUPPORTED_PIPELINES)}"
        )
    comps: dict[str, tuple[str, str]] = {}
    for name, (lib, allowed) in SUPPORTED_PIPELINES[cls].items():
        entry = data.get(name)
        if not (isinstance(entry, list) and len(entry) == 2):
            raise ModelLoadError(f"{path}: component {name!r} missing or not [library, class]")
        elib, ecls = entry
        if elib != lib or ecls not in allowed:
            raise ModelLoadError(
                f"{path}: component {name!r} is [{elib!r}, {ecls!r}]; supported: "
                f"[{lib!r}, one of {sorted(allowed)}]"
            )
        comps[name] = (elib, ecls)
    return ModelIndex(path, cls, comps)


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


def _default_param_loader(param: nn.Parameter, loaded: Any) -> None:
    shape = tuple(loaded.get_shape()) if not isinstance(loaded, torch.Tensor) else loaded.shape
    if tuple(shape) != tuple(param.shape):
        raise ValueError(f"shape {list(shape)} does not match the parameter's {list(param.shape)}")
    data = loaded if isinstance(loaded, torch.Tensor) else loaded[:]
    with torch.no_grad():
        param.data.copy_(data)


def _expected_shards(module: nn.Module, leaf: str) -> tuple:
    shard_map = getattr(module, "shard_map", None)
    if shard_map is None or (leaf not in ("weight", "bias")):
        return (None,)
    ids = tuple(s.shard_id for s in shard_map)
    return ids


def _iter_safetensors(files: list[str]):
    """``(source, name, lazy_slice)`` for every tensor of ``files`` (one file open at a time)."""
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                yield path, key, f.get_slice(key)


def load_tensors_into(
    model: nn.Module,
    tensors,
    name_map: NameMap | None = None,
    strict: bool = True,
    where: str = "checkpoint",
) -> int:
    """Fill ``model``'s parameters from ``(source, name, tensor_or_lazy_slice)`` triples.

    Each name is resolved with ``name_map.resolve_param`` to ``(our parameter, shard_id)``;
    parameters with a ``weight_loader`` receive the tensor (a lazy slice is read only where this
    rank needs it), the others are copied whole after a shape check.

    Args:
        model: the module to fill (parameters may be uninitialised).
        tensors: iterable of ``(source, name, tensor)``; ``source`` (a file path) is used in errors.
        name_map: checkpoint -> our names (``None``: identity).
        strict: unknown tensors and parameters left unloaded are errors.
        where: names the checkpoint in the "missing tensors" error.

    Returns:
        The number of tensors loaded.

    Raises:
        ModelLoadError: an unknown tensor, a shape mismatch, a tensor loaded twice or a missing
            tensor, naming the source and tensor (and the shard for fused layers).
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: dict[str, set] = defaultdict(set)
    n = 0
    for source, key, tensor in tensors:
        ours, shard_id = name_map.resolve_param(key) if name_map else (key, None)
        param = params.get(ours)
        if param is None:
            if strict:
                raise ModelLoadError(
                    f"{source}: tensor {key!r} (-> {ours!r}) matches no parameter of "
                    f"{type(model).__name__}"
                )
            continue
        loader = getattr(param, "weight_loader", None)
        try:
            if loader is not None:
                loader(param, tensor, shard_id)
            else:
                if shard_id is not None:
                    raise ValueError(f"parameter {ours!r} has no shard {shard_id!r}")
                _default_param_loader(param, tensor)
        except ValueError as e:
            raise ModelLoadError(
                f"{source}: cannot load tensor {key!r} into {ours!r}"
                + (f" (shard {shard_id!r})" if shard_id is not None else "")
                + f": {e}"
            ) from e
        if shard_id in loaded[ours] or (None in loaded[ours]):
            raise ModelLoadError(f"{source}: tensor {key!r} loads {ours!r} a second time")
        loaded[ours].add(shard_id)
        n += 1
    if strict:
        missing = []
        for name in params:
            mod_name, _, leaf = name.rpartition(".")
            expected = _expected_shards(modules.get(mod_name), leaf)
            got = loaded.get(name, set())
            if None in got:
                continue
            lacking = [s for s in expected if s not in got]
            if lacking:
                missing.append(name if lacking == [None] else f"{name} shards {lacking}")
        if missing:
            more = f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""
            raise ModelLoadError(
                f"{where}: checkpoint lacks tensors for: {', '.join(missing[:10])}{more}"
            )
    return n


def load_safetensors_into(
    model: nn.Module,
    component_dir: str,
    name_map: NameMap | None = None,
    strict: bool = True,
) -> dict[str, int]:
    """Fill ``model`` from the safetensors in ``component_dir`` (see :func:`load_tensors_into`;
    tensors are opened lazily, so a TP rank reads only its slices).

    Returns:
        ``{"tensors": n_read, "files": n_files}``.

    Raises:
        ModelLoadError: see :func:`load_tensors_into`; FileNotFoundError: see
            :func:`find_weight_files`.
    """
    files, _ = find_weight_files(component_dir)
    n = load_tensors_into(model, _iter_safetensors(files), name_map, strict, where=component_dir)
    return {"tensors": n, "files": len(files)}


def zimage_from_diffusers_module(
    reference: nn.Module,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    tp_rank: int | None = None,
    tp_size: int | None = None,
) -> ZImageTransformer:
    """Our DiT with the weights of an in-memory diffusers ``ZImageTransformer2DModel``
    (benchmarks and tests; same name map and weight loaders as file loading)."""
    cfg = ZImageArchConfig.from_dict(dict(reference.config))
    p = next(reference.parameters())
    model = ZImageTransformer(
        cfg,
        tp_rank=tp_rank,
        tp_size=tp_size,
        dtype=dtype or p.dtype,
        device=device or p.device,
    )
    items = (("<module>", k, v.detach()) for k, v in reference.state_dict().items())
    load_tensors_into(model, items, ZIMAGE_NAME_MAP, where="<module>")
    return model.eval()


def load_zimage_transformer(
    component_dir: str,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    tp_rank: int | None = None,
    tp_size: int | None = None,
) -> ZImageTransformer:
    """Build our Z-Image DiT from ``<model>/transformer`` and load its weights.

    Args:
        component_dir: the transformer folder (``config.json`` + safetensors).
        dtype, device: parameter dtype and device.
        tp_rank, tp_size: TP coordinates (default: the TP group's).

    Raises:
        ValueError: ``n_heads`` not divisible by the TP size (at build time, before any read),
            unknown ``_class_name``, or any error of :func:`load_safetensors_into`.
    """
    cfg = ZImageArchConfig.from_json_file(os.path.join(component_dir, "config.json"))
    model = ZImageTransformer(cfg, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, device=device)
    stats = load_safetensors_into(model, component_dir, ZIMAGE_NAME_MAP)
    logger.info(
        "loaded Z-Image transformer: %d tensors from %d files", stats["tensors"], stats["files"]
    )
    return model.eval()


def _check_config_class(component_dir: str, cfg_name: str, allowed: set[str]) -> None:
    path = os.path.join(component_dir, cfg_name)
    cfg = read_json(path)
    cls = cfg.get("_class_name") or (cfg.get("architectures") or [None])[0]
    if cls is not None and cls not in allowed:
        raise ModelLoadError(
            f"{path}: class {cls!r} is not supported; expected one of {sorted(allowed)}"
        )


def load_text_encoder(component_dir: str, dtype: torch.dtype, device) -> nn.Module:
    """Load the Qwen3 text encoder with transformers' ``Qwen3Model`` (eval mode)."""
    from transformers import Qwen3Model

    _check_config_class(component_dir, "config.json", {"Qwen3Model", "Qwen3ForCausalLM"})
    find_weight_files(component_dir)
    model = Qwen3Model.from_pretrained(component_dir, dtype=dtype)
    return model.to(device).eval()


def load_tokenizer(component_dir: str):
    """Load the tokenizer with transformers' ``AutoTokenizer`` (fast, from ``tokenizer.json``)."""
    from transformers import AutoTokenizer

    if not os.path.isdir(component_dir):
        raise FileNotFoundError(f"missing component directory: {component_dir}")
    return AutoTokenizer.from_pretrained(component_dir)


def load_vae(component_dir: str, dtype: torch.dtype, device) -> nn.Module:
    """Load the VAE with diffusers' ``AutoencoderKL`` (eval mode)."""
    from diffusers import AutoencoderKL

    _check_config_class(component_dir, "config.json", {"AutoencoderKL"})
    find_weight_files(component_dir)
    import diffusers
    from packaging.version import Version

    # diffusers >= 0.42 takes ``dtype`` (``torch_dtype`` is deprecated there)
    key = "dtype" if Version(diffusers.__version__) >= Version("0.42") else "torch_dtype"
    vae = AutoencoderKL.from_pretrained(component_dir, **{key: dtype})
    return vae.to(device).eval()


def load_scheduler_config(component_dir: str) -> dict:
    """Read ``scheduler/scheduler_config.json`` (the pipeline makes a fresh scheduler per call)."""
    path = os.path.join(component_dir, "scheduler_config.json")
    cfg = read_json(path)
    cls = cfg.get("_class_name", "FlowMatchEulerDiscreteScheduler")
    if cls != "FlowMatchEulerDiscreteScheduler":
        raise ModelLoadError(f"{path}: scheduler class {cls!r} is not supported")
    return cfg
