"""SGLang diffusion serving engine (the ``multimodal_gen`` part)."""

__version__ = "0.1.0"
