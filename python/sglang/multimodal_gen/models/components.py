"""Non-DiT components of a diffusers directory, loaded the way diffusers resolves them.

``model_index.json`` names each component as ``[library, class_name]``. The class is resolved with
diffusers' own resolver (``pipeline_loading_utils.get_class_obj_and_candidates``, which also maps
renamed transformers classes), so every class name ``DiffusionPipeline.from_pretrained`` accepts is
accepted here: ``TokenizersBackend``, ``Qwen2TokenizerFast``, ``CLIPTokenizer``, ``T5TokenizerFast``,
``AutoencoderKL``, any scheduler... Models load with ``from_pretrained(dir, dtype=...)`` and
safetensors only; tokenizers and schedulers with plain ``from_pretrained(dir)``. Only the
denoisers (our DiTs) are checked against what the family implements (``models.loader``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from sglang.multimodal_gen.models.model_dir import (
    MODEL_INDEX,
    ModelLoadError,
    find_weight_files,
)
from sglang.multimodal_gen.models.processors import is_processor_class, load_processor

logger = logging.getLogger(__name__)

__all__ = ["load_component", "resolve_class"]


def resolve_class(model_path: str, name: str, library: str, class_name: str) -> type:
    """The class of component ``name`` as diffusers resolves ``[library, class_name]``.

    Raises:
        ModelLoadError: unknown library or class, or custom code (never run).
    """
    if os.path.isfile(os.path.join(model_path, name, f"{library}.py")):
        raise ModelLoadError(
            f"{os.path.join(model_path, MODEL_INDEX)}: component {name!r} is custom code "
            f"({library}.py); custom code is not run"
        )
    from diffusers.pipelines.pipeline_loading_utils import (
        ALL_IMPORTABLE_CLASSES,
        get_class_obj_and_candidates,
    )

    try:
        cls, _ = get_class_obj_and_candidates(
            library, class_name, ALL_IMPORTABLE_CLASSES, None, False, component_name=name
        )
    except (ImportError, ValueError, AttributeError) as e:
        raise ModelLoadError(
            f"{os.path.join(model_path, MODEL_INDEX)}: component {name!r} = "
            f"[{library!r}, {class_name!r}] cannot be resolved: {e}"
        ) from e
    return cls


def _is_weighted_model(cls: type) -> bool:
    return isinstance(cls, type) and issubclass(cls, torch.nn.Module)


def _dtype_kwarg(cls: type) -> str:
    """``dtype`` (diffusers >= 0.42, transformers >= 4.56) or the older ``torch_dtype``."""
    from packaging.version import Version

    lib = cls.__module__.split(".")[0]
    if lib not in ("diffusers", "transformers"):
        return "torch_dtype"
    mod = __import__(lib)
    since = "0.42" if lib == "diffusers" else "4.56"
    return (
        "dtype"
        if Version(Version(mod.__version__).base_version) >= Version(since)
        else "torch_dtype"
    )


def load_component(
    model_path: str,
    name: str,
    library: str,
    class_name: str,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Any:
    """Load component ``name`` (e.g. ``"text_encoder"``, ``"tokenizer_2"``, ``"vae"``).

    Models (``torch.nn.Module`` subclasses) are loaded from safetensors only, in ``dtype``, moved
    to ``device`` and put in eval mode; other classes (tokenizers, schedulers, processors) with
    their own ``from_pretrained``; multimodal processors through
    :func:`~sglang.multimodal_gen.models.processors.load_processor`.

    Raises:
        FileNotFoundError: the component folder is missing.
        ModelLoadError: the class cannot be resolved, or the model has only pickle weights.
    """
    folder = os.path.join(model_path, name)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"missing component directory: {folder}")
    cls = resolve_class(model_path, name, library, class_name)
    if is_processor_class(cls):  # e.g. Qwen2VLProcessor, also without torchvision
        return load_processor(folder, cls)
    if not _is_weighted_model(cls):
        return cls.from_pretrained(folder)
    find_weight_files(folder)  # refuses pickle-only folders with a clear message
    kwargs: dict[str, Any] = {"use_safetensors": True}
    if dtype is not None:
        kwargs[_dtype_kwarg(cls)] = dtype
    model = cls.from_pretrained(folder, **kwargs)
    if device is not None:
        model = model.to(device)
    return model.eval()
