"""Loading our DiTs (the denoisers) from a diffusers-format model directory.

The directory's files are found and read by :mod:`~sglang.multimodal_gen.models.model_dir`. The
denoiser is built from OUR layers (the family's ``DenoiserSpec``) and filled through each
parameter's ``weight_loader``. Checkpoint names go through the family's name map (shared with LoRA
loading), so e.g. ``attention.to_q`` lands in shard ``"q"`` of ``attention.to_qkv``. Tensors are
opened lazily (``safetensors.safe_open(...).get_slice``): a TP rank reads only the rows/columns
of its shard, so its peak host memory is about its shard plus one replicated tensor.

The other components (text encoders, tokenizers, VAE, scheduler) are loaded as diffusers resolves
them (``models.components``). Errors name the file and the tensor
(``ValueError``/``FileNotFoundError``).
"""

from __future__ import annotations

import logging
import math
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from sglang.multimodal_gen.layers.linear import ParallelLinear
from sglang.multimodal_gen.models.model_dir import (
    DIFFUSERS_WEIGHT_STEMS,
    ModelLoadError,
    find_weight_files,
    read_json,
)
from sglang.multimodal_gen.models.name_map import NameMap
from sglang.multimodal_gen.models.quantization_config import (
    plan_quantization,
    quantized_tensors,
    read_header,
    resolve_quantization,
)
from sglang.multimodal_gen.models.registry import DenoiserSpec, resolve_object

logger = logging.getLogger(__name__)


def _default_param_loader(param: nn.Parameter, loaded: Any) -> None:
    shape = tuple(loaded.get_shape()) if not isinstance(loaded, torch.Tensor) else loaded.shape
    if tuple(shape) != tuple(param.shape):
        raise ValueError(f"shape {list(shape)} does not match the parameter's {list(param.shape)}")
    data = loaded if isinstance(loaded, torch.Tensor) else loaded[:]
    with torch.no_grad():
        param.data.copy_(data)


def _expected_shards(module: nn.Module, leaf: str) -> tuple:
    shard_map = getattr(module, "shard_map", None)
    if shard_map is None or leaf not in getattr(module, "checkpoint_params", ("weight", "bias")):
        return (None,)
    ids = tuple(s.shard_id for s in shard_map)
    return ids


def _reorder_rows(loaded: Any, order: tuple[int, ...]) -> Any:
    """Rows of ``loaded`` (a tensor or lazy slice) in our chunk order: chunk ``i`` of the result
    is chunk ``order[i]`` of the source (``NameRule.row_order``; e.g. BFL / Tencent final-layer
    modulations stored as ``(shift, scale)`` where ours is ``(scale, shift)``). A per-tensor
    scale of the module (one element; a lazy slice of a 0-d tensor cannot be read with ``[:]``)
    has no rows to reorder and is returned as given."""
    shape = loaded.shape if isinstance(loaded, torch.Tensor) else loaded.get_shape()
    if math.prod(shape) == 1:
        return loaded
    t = loaded if isinstance(loaded, torch.Tensor) else loaded[:]
    chunks = t.chunk(len(order), dim=0)
    return torch.cat([chunks[i] for i in order], dim=0)


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
        name_map: checkpoint -> our names (``None``: identity); tensors it calls unused
            (``NameMap.is_unused``) are skipped.
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
        if name_map is not None and name_map.is_unused(key):
            continue  # carried by the checkpoint's layout, not used by the model
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
        order = name_map.row_order(key.rpartition(".")[0]) if name_map else None
        if order is not None:  # the source stores the output rows in another chunk order
            tensor = _reorder_rows(tensor, order)
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


def _check_denoiser_class(component_dir: str, spec: DenoiserSpec) -> None:
    path = os.path.join(component_dir, "config.json")
    cls = read_json(path).get("_class_name")
    if cls is not None and cls not in spec.diffusers_classes:
        raise ModelLoadError(
            f"{path}: _class_name {cls!r} is not implemented for {spec.component!r}; expected "
            f"one of {list(spec.diffusers_classes)}"
        )


def build_denoiser(
    spec: DenoiserSpec,
    arch_config: Any,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    tp_rank: int | None = None,
    tp_size: int | None = None,
) -> nn.Module:
    """Our (uninitialised) DiT of ``spec`` for ``arch_config`` (a family config object)."""
    cls = resolve_object(spec.model_class)
    return cls(arch_config, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, device=device)


@dataclass(frozen=True)
class WeightOptions:
    """Where the primary denoiser's weights come from and how they are stored (the quantized
    checkpoint flags of SGLang's diffusion docs).

    Attributes:
        transformer_path: a transformer folder (its own ``config.json`` + safetensors) replacing
            the model's ``transformer/`` (``--transformer-path``).
        transformer_weights_path: a safetensors file or folder replacing the weights of the
            model's ``transformer/`` (its ``config.json`` kept; a quantization config may sit in
            the safetensors metadata) (``--transformer-weights-path``).
        quantization: quantize the floating-point denoisers while loading (``--quantization``;
            ``"fp8"``): every denoiser, both experts of a two-expert model.
        component: the denoiser the two paths apply to (``transformer``: the primary one; a
            two-expert model's ``transformer_2`` keeps its own files).
    """

    transformer_path: str | None = None
    transformer_weights_path: str | None = None
    quantization: str | None = None
    component: str = "transformer"

    def __post_init__(self):
        if self.transformer_path and self.transformer_weights_path:
            raise ValueError(
                "transformer_path and transformer_weights_path are exclusive: a transformer "
                "folder brings its own weights"
            )

    @property
    def empty(self) -> bool:
        return not (self.transformer_path or self.transformer_weights_path or self.quantization)


def weight_files(path: str) -> list[str]:
    """The safetensors files of ``path``: the file itself, a diffusers component folder's
    weights (an index file's shards included), or every ``*.safetensors`` of another folder.

    Raises:
        FileNotFoundError: no such path or no safetensors in it; ModelLoadError: see
            :func:`find_weight_files`.
    """
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise ModelLoadError(f"{path}: not a .safetensors file")
        return [path]
    if not os.path.isdir(path):
        return find_weight_files(path)[0]  # names the missing path
    names = os.listdir(path)
    if any(n.startswith(DIFFUSERS_WEIGHT_STEMS) for n in names):
        # a diffusers / transformers component: its index names the shards (a missing one is
        # an error, not a reason to read whatever else lies there)
        return find_weight_files(path)[0]
    files = sorted(os.path.join(path, n) for n in names if n.endswith(".safetensors"))
    return files or find_weight_files(path)[0]


def load_denoiser(
    component_dir: str,
    spec: DenoiserSpec,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    tp_rank: int | None = None,
    tp_size: int | None = None,
    weights_path: str | None = None,
    quantization: str | None = None,
) -> nn.Module:
    """Build a family's DiT from ``<model>/<component>`` and load its weights.

    Args:
        component_dir: the denoiser folder (``config.json`` + safetensors).
        spec: the family's :class:`~sglang.multimodal_gen.models.registry.DenoiserSpec`.
        dtype, device: compute dtype and device (quantized layers store their own dtypes).
        tp_rank, tp_size: TP coordinates (default: the TP group's).
        weights_path: read the weights from this safetensors file or folder instead of
            ``component_dir`` (whose ``config.json`` still describes the model; a
            ``quantization_config`` in the folder's own ``config.json`` applies).
        quantization: online quantization of a floating-point checkpoint (``"fp8"``).

    A quantized checkpoint (``models.quantization_config``) sets each linear layer's method
    before loading; the model is then built on the CPU (untouched pages cost nothing), filled
    and moved to ``device``, so no full-precision copy of a quantized layer is ever resident.
    The model's ``quantization`` attribute says how it is stored (``"modelopt fp8"``,
    ``"modelopt nvfp4"``, ``"comfyui fp8"``, ``"online fp8"``; ``None``: unquantized).

    Raises:
        FileNotFoundError: missing folder, config or weights.
        ModelLoadError / ValueError: a ``_class_name`` the family does not implement, a size not
            divisible by the TP size (at build time, before any read), an unsupported or
            inconsistent quantization (names the key), or any error of :func:`load_tensors_into`.
    """
    _check_denoiser_class(component_dir, spec)
    cfg_path = os.path.join(component_dir, "config.json")
    cfg_json = read_json(cfg_path)
    cfg = resolve_object(spec.config_class).from_json_file(cfg_path)
    source = weights_path or component_dir
    files = weight_files(source)
    header = read_header(files, source)
    qsource, qwhere = cfg_json, component_dir
    own_cfg = os.path.join(weights_path or "", "config.json")
    if weights_path and os.path.isdir(weights_path) and os.path.isfile(own_cfg):
        # a weights folder with its own config.json: its quantization_config applies
        own = read_json(own_cfg)
        if "quantization_config" in own and "quantization_config" not in cfg_json:
            qsource, qwhere = {"quantization_config": own["quantization_config"]}, weights_path
    qconfig = resolve_quantization(qsource, header, quantization, qwhere)
    name_map = resolve_object(spec.name_map)
    build_device = "cpu" if qconfig is not None else device
    model = build_denoiser(spec, cfg, dtype, build_device, tp_rank, tp_size)
    tensors = _iter_safetensors(files)
    if qconfig is not None:
        planned = plan_quantization(model, qconfig, header, name_map)
        tensors = quantized_tensors(qconfig, tensors)
        logger.info("%s: %d linear layers %s", spec.component, len(planned), qconfig.describe())
    n = load_tensors_into(model, tensors, name_map, where=source)
    if qconfig is not None:
        model = model.to(device)
    for m in model.modules():  # on the final device (the FP8 GEMM is probed there)
        if isinstance(m, ParallelLinear):
            m.process_weights_after_loading()
    model.quantization = qconfig.describe() if qconfig is not None else None
    logger.info("loaded %s: %d tensors from %d files", spec.component, n, len(files))
    return model.eval()


def denoiser_from_module(
    reference: nn.Module,
    spec: DenoiserSpec,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    tp_rank: int | None = None,
    tp_size: int | None = None,
) -> nn.Module:
    """Our DiT with the weights of an in-memory diffusers model of the same architecture
    (benchmarks and tests; same name map and weight loaders as file loading, strict).

    ``dtype`` defaults to the dtype holding most of the reference's parameters (models that keep
    some modules in fp32, as Wan does, are still "bf16 models"); ``device`` to its device."""
    cfg = resolve_object(spec.config_class).from_dict(dict(reference.config))
    counts: dict[torch.dtype, int] = defaultdict(int)
    for p in reference.parameters():
        counts[p.dtype] += p.numel()
    main_dtype = max(counts, key=counts.__getitem__)
    device = device or next(reference.parameters()).device
    model = build_denoiser(spec, cfg, dtype or main_dtype, device, tp_rank, tp_size)
    items = (("<module>", k, v.detach()) for k, v in reference.state_dict().items())
    load_tensors_into(model, items, resolve_object(spec.name_map), where="<module>")
    return model.eval()
