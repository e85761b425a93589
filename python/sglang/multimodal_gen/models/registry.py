"""The model-family registry: one declaration per family, looked up by ``model_index.json``.

A :class:`ModelFamily` says everything the runtime needs to serve a diffusers-format directory
without knowing the family: which pipeline ``_class_name`` values it serves, its denoisers (our
DiTs, built from our layers, with their name maps and LoRA targets), its staged pipeline class,
sampling defaults and limits, output modality, which numbers a TP size must divide, and how to
build an embedded tiny model. ``runtime/``, ``entrypoints/``, ``cli/`` and ``lora/`` only call the
functions of this module; family modules are imported lazily, by their dotted path, when a model
of that family is loaded.

Adding a family: write its files (config, DiT, name map, pipeline stages, a declaration module
under ``models/families/``); the registry finds the declaration, so no shared file changes.
"""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from sglang.multimodal_gen.configs.sampling_params import RequestLimits, SamplingParams
from sglang.multimodal_gen.models.model_dir import read_model_index

__all__ = [
    "DenoiserSpec",
    "ModelFamily",
    "SamplingDefaults",
    "UnknownModelError",
    "family_for_model",
    "get_family",
    "list_families",
    "register_family",
    "resolve_object",
]


# A model directory's own sampling defaults (see ModelFamily.sampling_defaults).
MODEL_DEFAULTS_KEY = "_sglang_defaults"
MODEL_DEFAULT_KEYS = ("height", "width", "num_inference_steps", "guidance_scale", "max_image_size")
#: Where the request fields every model takes are declared.
BASE_SAMPLING_PARAMS = "sglang.multimodal_gen.configs.sampling_params:SamplingParams"


class UnknownModelError(ValueError):
    """A model directory whose pipeline ``_class_name`` no registered family serves."""


def resolve_object(path: str) -> Any:
    """Import ``"package.module:attr"`` and return the attribute.

    Raises:
        ImportError / AttributeError: the module or attribute does not exist.
    """
    module, _, attr = path.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class SamplingDefaults:
    """Defaults and limits of a generation for one family (or one variant of it).

    Attributes:
        params: an instance of the family's ``SamplingParams`` class
            (:attr:`ModelFamily.sampling_params`) holding the default of every field (``None``
            where the model has none, e.g. a second expert's guidance on a one-expert model).
        limits: what the model's position tables and text encoder cover
            (``max_image_size``, ``max_num_frames``, ``max_sequence_length``).
        outputs: ``"image"`` or ``"video"``.
        inputs: the conditioning the model takes (``("text",)``; ``"image"``: input images,
            ``"mask"``: an inpainting mask).
        required_inputs: the conditioning every request must give (an edit model adds
            ``"image"``).
    """

    params: SamplingParams
    limits: RequestLimits = field(default_factory=RequestLimits)
    outputs: str = "image"
    inputs: tuple[str, ...] = ("text",)
    required_inputs: tuple[str, ...] = ("text",)


@dataclass(frozen=True)
class DenoiserSpec:
    """One denoiser of a family (``transformer``; ``transformer_2`` for two-expert models).

    Attributes:
        component: the component folder / ``model_index.json`` key.
        diffusers_classes: the ``_class_name`` values of its ``config.json`` we implement.
        config_class: ``"module:Class"`` with ``from_dict`` / ``from_json_file``.
        model_class: ``"module:Class"``, called as ``Class(cfg, tp_rank=, tp_size=, dtype=,
            device=)``; parameters are filled by ``models.loader.load_denoiser``.
        name_map: ``"module:NAME"`` of the :class:`~sglang.multimodal_gen.models.name_map.NameMap`
            shared by weight loading and LoRA loading.
        lora_target: the LoRA ``target`` name of this denoiser.
        optional: a directory may leave it out (``[null, null]`` in ``model_index.json``), e.g.
            ``transformer_2`` of a one-expert Wan directory.
    """

    component: str
    diffusers_classes: tuple[str, ...]
    config_class: str
    model_class: str
    name_map: str
    lora_target: str = "transformer"
    optional: bool = False


@dataclass(frozen=True)
class ModelFamily:
    """A model family, declared once (see the module docstring).

    Attributes:
        name: short id (``"zimage"``, ``"flux"``), shown in ``/v1/models``.
        display_name: human name for messages (``"Z-Image"``).
        pipeline_classes: the ``model_index.json`` ``_class_name`` values served.
        pipeline: ``"module:Class"`` of the staged pipeline (``pipelines.base.StagedPipeline``).
        denoisers: the denoisers, ``transformer`` first.
        defaults: ``fn(arch_config) -> SamplingDefaults`` (variants differ, e.g. Flux dev vs
            schnell), or one :class:`SamplingDefaults` for every variant.
        sampling_params: ``"module:Class"`` of the family's ``SamplingParams`` subclass: the
            request fields it adds to the common ones (declared in its ``configs/`` module);
            the HTTP schema, the CLI flags and ``/v1/models`` derive from it.
        tp_divisors: ``fn(arch_config) -> {what: number}``: every TP size must divide each number
            (attention heads, FFN hidden size...); the entry whose name mentions "heads" also
            guides the automatic Ulysses degree (``configs.parallel.resolve_layout``).
        build_tiny: ``"module:function"`` writing a tiny random-weight model directory
            (``fn(path, seed=...) -> path``), for tests, and the default model of a family
            without :attr:`embedded_model`.
        embedded_model: ``"package:relative/dir"`` of a trained diffusers-format directory
            shipped inside the package (package data); the family's default model when set, and
            the family that declares one is the server's default family
            (``models.default_model``; at most one family may).
        embedded_lora: ``"package:relative/dir"`` of a LoRA folder for :attr:`embedded_model`
            shipped as package data (``models.default_model.demo_lora_path``).
        default_model_name: the served name of the default model.
        lora_signature: regexes (``re.search`` on each key of a LoRA file) that mark a key as
            written for this family's denoiser, in the spellings LoRA files use (diffusers names,
            kohya's flattened ``lora_unet_...``, the original checkpoint's names). When a file
            matches none of a model's modules, ``lora.key_grammar.guess_architecture`` says which
            model it seems to be for: the family (or non-served architecture) whose patterns
            match the most keys; on a tie, the one that matched the longest piece of a key
            (``lora.key_grammar.best_architecture``). Keep the patterns specific to the family:
            keys that another family's patterns also match count for both. Empty: the family is
            never guessed.
        lora_architecture: the name that guess reports (``None``: :attr:`display_name`), e.g.
            ``"Flux"`` for a file that could be for any Flux version.
    """

    name: str
    display_name: str
    pipeline_classes: tuple[str, ...]
    pipeline: str
    denoisers: tuple[DenoiserSpec, ...]
    defaults: Callable[[Any], SamplingDefaults] | SamplingDefaults | None = None
    sampling_params: str = BASE_SAMPLING_PARAMS
    tp_divisors: Callable[[Any], Mapping[str, int]] | None = None
    build_tiny: str | None = None
    embedded_model: str | None = None
    embedded_lora: str | None = None
    default_model_name: str | None = None
    lora_signature: tuple[str, ...] = ()
    lora_architecture: str | None = None
    extra: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ helpers
    def denoiser(self, component: str = "transformer") -> DenoiserSpec:
        """The :class:`DenoiserSpec` of ``component`` (``KeyError`` if the family has none)."""
        for d in self.denoisers:
            if d.component == component:
                return d
        raise KeyError(f"{self.display_name} has no denoiser {component!r}")

    def read_config(self, model_path: str, component: str = "transformer") -> Any:
        """The architecture config of a denoiser, from ``<model_path>/<component>/config.json``."""
        spec = self.denoiser(component)
        cfg_cls = resolve_object(spec.config_class)
        return cfg_cls.from_json_file(os.path.join(model_path, component, "config.json"))

    def params_class(self) -> type[SamplingParams]:
        """The family's ``SamplingParams`` class (:attr:`sampling_params`)."""
        return resolve_object(self.sampling_params)

    def sampling_defaults(self, arch_config: Any) -> SamplingDefaults:
        """The family's defaults for ``arch_config``, with the model directory's own overrides.

        A denoiser ``config.json`` may carry ``"_sglang_defaults": {"height": 64, ...}`` (keys
        :data:`MODEL_DEFAULT_KEYS`; diffusers ignores ``_`` keys), e.g. the embedded demo model,
        which is trained at 64x64; real checkpoints keep the family's defaults.

        Raises:
            ValueError: ``_sglang_defaults`` is not an object or names another key; the
                declaration's defaults are not of the family's parameter class.
        """
        d = self.defaults
        d = d if isinstance(d, SamplingDefaults) else d(arch_config)
        if type(d.params) is not self.params_class():
            raise ValueError(
                f"{self.display_name}: defaults are a {type(d.params).__name__}, not the "
                f"family's {self.params_class().__name__}"
            )
        own = (getattr(arch_config, "extra", None) or {}).get(MODEL_DEFAULTS_KEY)
        if own is None:
            return d
        if not isinstance(own, dict) or set(own) - set(MODEL_DEFAULT_KEYS):
            raise ValueError(
                f"{MODEL_DEFAULTS_KEY} must be an object with keys among "
                f"{list(MODEL_DEFAULT_KEYS)}, got {own!r}"
            )
        own = dict(own)
        limits = d.limits
        if "max_image_size" in own:
            limits = replace(limits, max_image_size=own.pop("max_image_size"))
        return replace(d, params=d.params.replace(**own), limits=limits)

    def valid_tp_sizes(self, arch_config: Any, limit: int = 8) -> list[int]:
        """TP sizes in ``[1, limit]`` that divide every number of :attr:`tp_divisors`."""
        nums = list((self.tp_divisors(arch_config) if self.tp_divisors else {}).values())
        g = 0
        for n in nums:
            g = math.gcd(g, int(n))
        return [t for t in range(1, limit + 1) if g == 0 or g % t == 0]

    def check_tp_size(self, arch_config: Any, tp_size: int) -> None:
        """Raises ``ValueError`` naming the number a TP size fails to divide."""
        for what, n in (self.tp_divisors(arch_config) if self.tp_divisors else {}).items():
            if int(n) % tp_size:
                raise ValueError(
                    f"{self.display_name}: {what}={n} is not divisible by tp_size={tp_size}; "
                    f"valid TP sizes: {self.valid_tp_sizes(arch_config)}"
                )

    def attention_heads(self, arch_config: Any) -> int | None:
        """The attention head count (the :attr:`tp_divisors` entry that names heads)."""
        divisors = self.tp_divisors(arch_config) if self.tp_divisors else {}
        return next((int(n) for what, n in divisors.items() if "heads" in what), None)

    def check_parallel_layout(self, arch_config: Any, layout: Any) -> None:
        """Check a :class:`~sglang.multimodal_gen.distributed.ParallelLayout` against the model.

        TP must divide every number of :attr:`tp_divisors` (each TP rank holds a whole share of
        the heads and FFN units). Ulysses, ring and CFG degrees fit any model: a Ulysses degree
        that does not divide the heads left on each TP rank splits them unevenly over its ranks
        (``layers.attention``).

        Raises:
            ValueError: naming the number the TP size does not divide and the TP sizes that do.
        """
        self.check_tp_size(arch_config, layout.tp_size)

    def pipeline_class(self) -> type:
        return resolve_object(self.pipeline)


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Add ``family`` to the registry (its name and pipeline classes must be new).

    Raises:
        ValueError: a family of that name, or one serving one of its pipeline classes, exists.
    """
    if family.name in _FAMILIES:
        raise ValueError(f"model family {family.name!r} is registered twice")
    for other in _FAMILIES.values():
        both = set(other.pipeline_classes) & set(family.pipeline_classes)
        if both:
            raise ValueError(f"{sorted(both)} served by both {other.name!r} and {family.name!r}")
    _FAMILIES[family.name] = family
    return family


def _ensure_loaded() -> None:
    # the declarations are small modules found in their package (a plugin discovery: the
    # registry names no family); importing them registers every family
    importlib.import_module("sglang.multimodal_gen.models.families").import_declarations()


def list_families() -> list[ModelFamily]:
    """Every registered family, sorted by name (registration follows import order, which a
    program that imports one family's module first would change)."""
    _ensure_loaded()
    return sorted(_FAMILIES.values(), key=lambda f: f.name)


def get_family(name: str) -> ModelFamily:
    """The family called ``name``.

    Raises:
        UnknownModelError: no such family (the message lists the registered ones).
    """
    _ensure_loaded()
    if name not in _FAMILIES:
        raise UnknownModelError(f"unknown model family {name!r}; served: {sorted(_FAMILIES)}")
    return _FAMILIES[name]


def family_for_model(model_path: str) -> ModelFamily:
    """The family serving the diffusers directory ``model_path`` (by its pipeline class).

    Raises:
        FileNotFoundError: no directory or no ``model_index.json``.
        UnknownModelError: a ``_class_name`` no family serves (lists the families and classes).
    """
    index = read_model_index(model_path)
    for fam in list_families():
        if index.pipeline_class in fam.pipeline_classes:
            return fam
    served = ", ".join(
        f"{f.display_name} ({'/'.join(f.pipeline_classes)})" for f in _FAMILIES.values()
    )
    raise UnknownModelError(
        f"{index.path}: pipeline _class_name {index.pipeline_class!r} is not served; "
        f"model families served: {served}"
    )
