"""Which quantization a transformer checkpoint uses, and which of our layers it quantizes.

Three sources, checked in this order:

* ModelOpt (NVIDIA TensorRT-Model-Optimizer exports, as SGLang's diffusion loader reads them): a
  ``quantization_config`` in the component's ``config.json`` or, for raw exports, a JSON string
  under ``quantization_config`` in the safetensors header metadata. ``quant_method: "modelopt"``,
  ``quant_algo`` ``"FP8"`` or ``"NVFP4"`` (``"FP4"``), ``group_size`` 16 (top level or
  ``config_groups.*.weights.group_size``), ``ignore``: glob patterns matched against the whole
  checkpoint module name (``fnmatch``; ``proj_out`` is only the top-level module).
* ComfyUI scaled FP8 single files: a ``scaled_fp8`` marker tensor with per-layer ``scale_weight``
  (and optional ``scale_input``), or the newer per-layer ``comfy_quant`` markers with
  ``weight_scale`` / ``input_scale``. A layer is quantized exactly when its weight is FP8.
* Online: ``--quantization fp8`` quantizes every linear layer of a floating-point checkpoint while
  loading (per-output-channel scales).

:func:`plan_quantization` resolves every checkpoint weight to our layer (through the family's
name map) and sets each :class:`~sglang.multimodal_gen.layers.linear.ParallelLinear`'s method
before a byte is read; a checkpoint that disagrees with its own declaration (a quantized weight
the config ignores, an unquantized one it does not, a fused layer of ours whose sources mix the
two) is refused with a :class:`ModelLoadError` naming the tensor.
"""

from __future__ import annotations

import fnmatch
import json
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from sglang.multimodal_gen.layers.linear import ParallelLinear
from sglang.multimodal_gen.layers.quantization import (
    Fp8LinearMethod,
    Nvfp4LinearMethod,
    QuantizationMethod,
)
from sglang.multimodal_gen.layers.quantization.base import tensor_dtype
from sglang.multimodal_gen.models.model_dir import ModelLoadError

__all__ = [
    "ONLINE_QUANTIZATIONS",
    "CheckpointHeader",
    "QuantizationConfig",
    "plan_quantization",
    "quantized_tensors",
    "read_header",
    "resolve_quantization",
]

#: ``--quantization`` values (online quantization of a floating-point checkpoint)
ONLINE_QUANTIZATIONS = ("fp8",)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_COMFY_ALIASES = {"scale_weight": "weight_scale", "scale_input": "input_scale"}
_COMFY_MARKERS = ("scaled_fp8",)


@dataclass
class CheckpointHeader:
    """Names, dtypes and shapes of a checkpoint's tensors, read from the safetensors headers
    (no tensor data), plus the files' header metadata merged (a key's first value, in file
    order: one shard may carry ``quantization_config`` beside others' ``{"format": "pt"}``)."""

    dtypes: dict[str, torch.dtype | str] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    where: str = "checkpoint"


def read_header(files: Iterable[str], where: str) -> CheckpointHeader:
    """Read the tensor table and metadata of safetensors ``files`` (headers only).

    Raises:
        ModelLoadError: two files whose metadata carry different ``quantization_config``s.
    """
    h = CheckpointHeader(where=where)
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for k, v in (f.metadata() or {}).items():
                if k == "quantization_config" and k in h.metadata:
                    _same_config(h.metadata[k], v, path, where)
                h.metadata.setdefault(k, v)
            for key in f.keys():
                sl = f.get_slice(key)
                h.dtypes[key] = tensor_dtype(sl)
                h.shapes[key] = tuple(sl.get_shape())
    return h


def _same_config(first: str, other: str, path: str, where: str) -> None:
    """Refuse a shard whose metadata ``quantization_config`` differs from an earlier shard's
    (compared as JSON when both parse, else as text)."""
    try:
        same = json.loads(first) == json.loads(other)
    except json.JSONDecodeError:
        same = first == other
    if not same:
        raise ModelLoadError(
            f"{where}: {path} has a safetensors metadata 'quantization_config' that differs "
            "from an earlier file's"
        )


def _dtype_name(d: torch.dtype | str) -> str:
    return str(d).replace("torch.", "")


@dataclass(frozen=True)
class QuantizationConfig:
    """A checkpoint's quantization, as far as loading needs it.

    Attributes:
        algo: ``"fp8"`` or ``"nvfp4"``.
        source: ``"modelopt"``, ``"comfyui"`` or ``"online"``.
        group_size: NVFP4 block size (16).
        ignore: ModelOpt's ``ignore`` globs (checkpoint module names left unquantized).
        static_input_scale: layers carry an ``input_scale`` (required then).
        aliases: checkpoint leaf names -> ours (ComfyUI's ``scale_weight``).
    """

    algo: str
    source: str
    group_size: int = 16
    ignore: tuple[str, ...] = ()
    static_input_scale: bool = True
    aliases: tuple[tuple[str, str], ...] = ()

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_modelopt(cls, qc: Any, where: str) -> QuantizationConfig:
        """Parse a ModelOpt ``quantization_config`` object.

        Raises:
            ModelLoadError: not an object, another ``quant_method``, an algorithm other than FP8
                / NVFP4 (AWQ, mixed precision...), a group size other than 16, swizzled scales or
                a malformed ``ignore`` (names ``where`` and the field).
        """
        if not isinstance(qc, dict):
            raise ModelLoadError(f"{where}: quantization_config must be an object")
        method = qc.get("quant_method")
        if method != "modelopt":
            raise ModelLoadError(
                f"{where}: quantization_config.quant_method {method!r} is not supported "
                "(only 'modelopt' checkpoints: quant_algo FP8 or NVFP4)"
            )
        algo_raw = qc.get("quant_algo")
        algo = {"FP8": "fp8", "NVFP4": "nvfp4", "FP4": "nvfp4"}.get(str(algo_raw).upper())
        if algo is None:
            raise ModelLoadError(
                f"{where}: quantization_config.quant_algo {algo_raw!r} is not supported "
                "(FP8, NVFP4 or FP4)"
            )
        for flag in ("swizzled", "swizzle", "scale_swizzled", "weight_scale_swizzled"):
            if qc.get(flag):
                raise ModelLoadError(
                    f"{where}: quantization_config.{flag} is set; swizzled block scales are not "
                    "supported (row-major weight_scale only)"
                )
        group = qc.get("group_size")
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, dict):
            raise ModelLoadError(
                f"{where}: quantization_config.config_groups must be an object of groups"
            )
        for gname, g in groups.items():
            weights = (g or {}).get("weights") if isinstance(g, dict) or g is None else None
            if g is not None and (not isinstance(g, dict) or not isinstance(weights or {}, dict)):
                raise ModelLoadError(
                    f"{where}: quantization_config.config_groups.{gname} must be an object with "
                    "a 'weights' object"
                )
            if group is None and (weights or {}).get("group_size") is not None:
                group = weights["group_size"]
        group = 16 if group is None else group
        if isinstance(group, bool) or not isinstance(group, int):
            raise ModelLoadError(
                f"{where}: quantization_config.group_size must be an integer, got {group!r}"
            )
        if algo == "nvfp4" and group != 16:
            raise ModelLoadError(
                f"{where}: quantization_config.group_size {group!r} is not supported for NVFP4 "
                "(16 only)"
            )
        ignore = qc.get("ignore", qc.get("exclude_modules", [])) or []
        if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
            raise ModelLoadError(f"{where}: quantization_config.ignore must be a list of strings")
        return cls(algo, "modelopt", int(group), tuple(ignore), True)

    @classmethod
    def online(cls, name: str) -> QuantizationConfig:
        """``--quantization NAME`` (see :data:`ONLINE_QUANTIZATIONS`).

        Raises:
            ValueError: an unknown name (names ``quantization``).
        """
        if name not in ONLINE_QUANTIZATIONS:
            raise ValueError(
                f"quantization {name!r} is not supported; choose from {list(ONLINE_QUANTIZATIONS)}"
            )
        return cls(name, "online", static_input_scale=False)

    @classmethod
    def comfyui(cls, header: CheckpointHeader) -> QuantizationConfig:
        """ComfyUI scaled FP8 (``scaled_fp8`` marker or ``comfy_quant`` layers). A layer is
        quantized exactly when its weight is ``float8_e4m3fn`` with a scale; the ``comfy_quant``
        markers' contents are not read, so another format (E5M2, NVFP4, INT8...) is refused by
        :func:`plan_quantization`'s dtype and scale checks, naming the weight.

        Raises:
            ModelLoadError: an E5M2 ``scaled_fp8`` marker (names the tensor).
        """
        marker = header.dtypes.get("scaled_fp8")
        if marker is not None and marker != torch.float8_e4m3fn:
            raise ModelLoadError(
                f"{header.where}: tensor 'scaled_fp8' is {_dtype_name(marker)}; only "
                "float8_e4m3fn scaled checkpoints are supported"
            )
        static = any(k.endswith((".scale_input", ".input_scale")) for k in header.dtypes)
        return cls(
            "fp8", "comfyui", static_input_scale=static, aliases=tuple(_COMFY_ALIASES.items())
        )

    # ------------------------------------------------------------------ per layer
    def ignores(self, module: str) -> bool:
        """Whether ModelOpt's ``ignore`` globs leave checkpoint module ``module`` unquantized."""
        return any(fnmatch.fnmatchcase(module, p) for p in self.ignore)

    def stored_dtype(self) -> torch.dtype:
        """The dtype of a quantized ``weight`` in the checkpoint."""
        return torch.uint8 if self.algo == "nvfp4" else torch.float8_e4m3fn

    def make_method(self, static_input_scale: bool | None = None) -> QuantizationMethod:
        """A fresh method object for one layer."""
        if self.algo == "nvfp4":
            return Nvfp4LinearMethod(self.group_size)
        static = self.static_input_scale if static_input_scale is None else static_input_scale
        return Fp8LinearMethod(online=self.source == "online", static_input_scale=static)

    def describe(self) -> str:
        return f"{self.source} {self.algo}"

    def tensor_name(self, key: str) -> str:
        """A checkpoint key with ComfyUI's leaf names mapped to ours (``x.scale_weight`` ->
        ``x.weight_scale``)."""
        if not self.aliases:
            return key
        module, _, leaf = key.rpartition(".")
        for old, new in self.aliases:
            if leaf == old:
                return f"{module}.{new}"
        return key

    def skips(self, key: str) -> bool:
        """Checkpoint entries that are markers, not weights (``scaled_fp8``, ``*.comfy_quant``)."""
        return self.source == "comfyui" and (key in _COMFY_MARKERS or key.endswith(".comfy_quant"))


def resolve_quantization(
    config_json: dict, header: CheckpointHeader, quantization: str | None, where: str
) -> QuantizationConfig | None:
    """The checkpoint's :class:`QuantizationConfig` (``None``: unquantized).

    Args:
        config_json: the transformer's ``config.json`` (may carry ``quantization_config``).
        header: the weights' :func:`read_header` (raw exports keep the config in its metadata).
        quantization: ``--quantization`` (online), or ``None``.

    Raises:
        ModelLoadError: see :meth:`QuantizationConfig.from_modelopt`; ``--quantization`` given
            for a checkpoint that is already quantized; an unreadable header config.
        ValueError: an unknown ``quantization`` value.
    """
    found: QuantizationConfig | None = None
    if "quantization_config" in config_json:
        found = QuantizationConfig.from_modelopt(
            config_json["quantization_config"], f"{where}/config.json"
        )
    elif "quantization_config" in header.metadata:
        try:
            qc = json.loads(header.metadata["quantization_config"])
        except json.JSONDecodeError as e:
            raise ModelLoadError(
                f"{header.where}: safetensors metadata 'quantization_config' is not JSON ({e})"
            ) from e
        found = QuantizationConfig.from_modelopt(qc, f"{header.where} (safetensors metadata)")
    elif any(k in _COMFY_MARKERS or k.endswith(".comfy_quant") for k in header.dtypes):
        found = QuantizationConfig.comfyui(header)
    if quantization is not None:
        if found is not None:
            raise ModelLoadError(
                f"{header.where}: --quantization {quantization} asks to quantize a checkpoint "
                f"that is already quantized ({found.describe()}); drop --quantization"
            )
        return QuantizationConfig.online(quantization)
    return found


def _linear_layers(model: nn.Module) -> dict[str, ParallelLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, ParallelLinear)}


def plan_quantization(
    model: nn.Module, config: QuantizationConfig, header: CheckpointHeader, name_map
) -> dict[str, str]:
    """Give each linear layer of ``model`` the method the checkpoint says (before loading).

    A layer is quantized when the sources that load its ``weight`` (checkpoint modules, through
    ``name_map``) are; the checkpoint's dtypes must agree with the declaration.

    Returns:
        ``{our layer name: method description}`` of the quantized layers.

    Raises:
        ModelLoadError: a quantized weight the config does not quantize, or the reverse; a fused
            layer whose sources mix quantized and unquantized weights; a quantized weight of a
            module that is not a linear layer here; a quantized source lacking a scale the
            method reads (``weight_scale``, ``weight_scale_2``, ``input_scale``, ComfyUI's
            ``scale_weight``); a layer the method cannot shard (each names the checkpoint key).
    """
    layers = _linear_layers(model)
    where = header.where
    if config.source == "online":
        for layer in layers.values():
            layer.set_quant_method(config.make_method())
        return {n: layer.quant_method.describe() for n, layer in layers.items()}
    sources: dict[str, list[tuple[str, bool]]] = defaultdict(list)
    stored = config.stored_dtype()
    for key, dtype in header.dtypes.items():
        if config.skips(key) or not key.endswith(".weight"):
            continue
        module = key[: -len(".weight")]
        ours, _ = name_map.resolve(module) if name_map is not None else (module, None)
        if ours not in layers:  # norms, convolutions, embeddings: never quantized here
            if (
                dtype in (torch.float8_e4m3fn, torch.uint8)
                or f"{module}.weight_scale" in header.dtypes
            ):
                raise ModelLoadError(
                    f"{where}: tensor {key!r} is quantized ({_dtype_name(dtype)}), but {ours!r} "
                    f"is not a linear layer of {type(model).__name__}"
                )
            continue
        if config.source == "comfyui":
            quantized = dtype == torch.float8_e4m3fn
            scales = ("scale_weight", "weight_scale")
            has_scale = any(f"{module}.{leaf}" in header.dtypes for leaf in scales)
            if quantized and not has_scale:
                raise ModelLoadError(
                    f"{where}: tensor {module + '.scale_weight'!r} is missing: {key!r} is "
                    "float8_e4m3fn and a ComfyUI scaled FP8 weight needs its scale"
                )
            if has_scale and not quantized:
                raise ModelLoadError(
                    f"{where}: tensor {key!r} ({_dtype_name(dtype)}) is not FP8 but has a "
                    "weight scale"
                )
        else:
            # the diffusers module name: without a wrapper prefix the name map strips
            bare = module
            for prefix in getattr(name_map, "strip_prefixes", ()):
                if bare.startswith(prefix):
                    bare = bare[len(prefix) :]
                    break
            quantized = not config.ignores(bare)
            if quantized and dtype != stored:
                raise ModelLoadError(
                    f"{where}: tensor {key!r} is {_dtype_name(dtype)}, but quantization_config "
                    f"({config.describe()}) quantizes {module!r} (expected {_dtype_name(stored)}; "
                    "a module left unquantized must match an 'ignore' pattern)"
                )
            if not quantized and dtype not in _FLOAT_DTYPES:
                raise ModelLoadError(
                    f"{where}: tensor {key!r} is {_dtype_name(dtype)}, but module {module!r} "
                    "matches quantization_config.ignore (expected a floating-point weight)"
                )
        sources[ours].append((key, quantized))
    planned = {}
    for ours, entries in sources.items():
        flags = {q for _, q in entries}
        if len(flags) > 1:
            mixed = ", ".join(f"{k!r} ({'quantized' if q else 'unquantized'})" for k, q in entries)
            raise ModelLoadError(
                f"{where}: the sources of fused layer {ours!r} mix quantized and unquantized "
                f"weights: {mixed}"
            )
        if not flags.pop():
            continue
        static = config.static_input_scale
        if config.source == "comfyui":  # per layer: a scale_input / input_scale present
            static = all(
                any(
                    f"{k[: -len('.weight')]}.{leaf}" in header.dtypes
                    for leaf in ("scale_input", "input_scale")
                )
                for k, _ in entries
            )
        method = config.make_method(static)
        _check_complete(config, method, [k for k, _ in entries], header)
        try:
            layers[ours].set_quant_method(method)
        except ValueError as e:
            raise ModelLoadError(f"{where}: tensor {entries[0][0]!r}: {e}") from e
        planned[ours] = layers[ours].quant_method.describe()
    return planned


def _check_complete(
    config: QuantizationConfig,
    method: QuantizationMethod,
    weight_keys: list[str],
    header: CheckpointHeader,
) -> None:
    """Every quantized source module in ``weight_keys`` (``<module>.weight``) has the tensors
    ``method`` reads besides its weight (NVFP4: ``weight_scale``, ``weight_scale_2``,
    ``input_scale``; ModelOpt FP8: ``weight_scale``, ``input_scale``; ComfyUI: ``scale_weight``),
    checked on the header before any tensor is read.

    Raises:
        ModelLoadError: naming the first missing checkpoint key (``<module>.<leaf>`` in the
            checkpoint's own leaf names: ComfyUI's ``scale_weight`` / ``scale_input``).
    """
    checkpoint_names = defaultdict(list)  # our leaf -> the checkpoint's names for it
    for old, new in config.aliases:
        checkpoint_names[new].append(old)
    for key in weight_keys:
        module = key[: -len(".weight")]
        for leaf in method.checkpoint_params:
            if leaf == "weight":
                continue
            names = checkpoint_names[leaf] + [leaf]
            if not any(f"{module}.{n}" in header.dtypes for n in names):
                raise ModelLoadError(
                    f"{header.where}: tensor {module + '.' + names[0]!r} is missing: "
                    f"{config.describe()} quantizes {key!r}, which needs "
                    + ", ".join(
                        f"{module}.{checkpoint_names[p][0] if checkpoint_names[p] else p}"
                        for p in method.checkpoint_params
                        if p != "weight"
                    )
                )


def quantized_tensors(
    config: QuantizationConfig, tensors: Iterable[tuple[str, str, Any]]
) -> Iterator[tuple[str, str, Any]]:
    """``(source, name, tensor)`` triples with ComfyUI's markers dropped and its leaf names
    mapped to ours (:meth:`QuantizationConfig.tensor_name`)."""
    for source, key, t in tensors:
        if config.skips(key):
            continue
        yield source, config.tensor_name(key), t
