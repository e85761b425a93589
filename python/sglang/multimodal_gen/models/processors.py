"""Multimodal processors (transformers' ``ProcessorMixin`` classes, e.g. ``Qwen2VLProcessor``,
the ``processor`` component of the Qwen-Image edit pipelines) loaded where an optional backend is
missing.

``Qwen2VLProcessor`` bundles a tokenizer, an image processor and a video processor. Without
torchvision (whose wheel is CUDA-linked and absent from CPU installs) its video processor cannot
be imported, and transformers then refuses to build the processor at all, although image + text
prompts never touch the video part. :func:`load_processor` first tries the class's own
``from_pretrained``; when that fails on an import, it builds the same class from the parts that do
load: the tokenizer (``AutoTokenizer``) and the image processor (``AutoImageProcessor``, which
falls back to the PIL image processor, e.g. ``Qwen2VLImageProcessorPil``, when the fast one needs
torchvision), with the parts that cannot import left ``None``. Text and image inputs are then
processed by the class's own ``__call__`` (the image-token expansion included); a call with
videos fails in transformers.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["is_processor_class", "load_processor", "tolerant_processor_class"]

logger = logging.getLogger(__name__)


def is_processor_class(cls: type) -> bool:
    """Whether ``cls`` is a transformers multimodal processor (``ProcessorMixin``)."""
    try:
        from transformers.processing_utils import ProcessorMixin
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(cls, type) and issubclass(cls, ProcessorMixin)


def tolerant_processor_class(cls: type) -> type:
    """``cls`` whose constructor accepts ``None`` for a part (transformers checks each part's base
    class, and the base class of video processors does not import without torchvision)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument is None:
            return None
        return cls.check_argument_for_proper_class(self, argument_name, argument)

    return type(
        cls.__name__,
        (cls,),
        {
            "check_argument_for_proper_class": check_argument_for_proper_class,
            "__module__": cls.__module__,
            "__doc__": cls.__doc__,
        },
    )


def _load_part(name: str, folder: str) -> Any:
    from transformers import AutoImageProcessor, AutoTokenizer

    if name == "tokenizer":
        return AutoTokenizer.from_pretrained(folder)
    if name == "image_processor":
        return AutoImageProcessor.from_pretrained(folder)
    return None  # video processors, feature extractors...: not used for text + image prompts


def load_processor(folder: str, cls: type) -> Any:
    """The ``cls`` processor saved in ``folder``.

    Args:
        folder: the component folder (``<model>/processor``).
        cls: a ``ProcessorMixin`` subclass (the class ``model_index.json`` names).

    Returns:
        ``cls.from_pretrained(folder)``; when a part's backend cannot be imported, an instance of
        a subclass of ``cls`` (same name, same methods) holding the tokenizer and image processor
        of ``folder`` and ``None`` for the other parts.

    Raises:
        OSError / ValueError: from transformers, when the tokenizer or image processor itself
            cannot be loaded.
    """
    try:
        return cls.from_pretrained(folder)
    except (ImportError, AttributeError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        logger.info("%s: %s; loading its tokenizer and image processor only", cls.__name__, reason)
    parts = {name: _load_part(name, folder) for name in cls.get_attributes()}
    return tolerant_processor_class(cls)(**parts)
