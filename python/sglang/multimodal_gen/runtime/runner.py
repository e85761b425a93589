"""One TP rank's model: the Z-Image pipeline plus its LoRA manager, driven by named commands.

The engine runs one :class:`ModelRunner` in-process (TP 1) or one per worker process (TP N). In
the latter case rank 0 receives every command and broadcasts it, and every rank calls
:meth:`ModelRunner.execute` with the same command in the same order, so weights (base and LoRA)
stay identical across ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.models.dits.zimage_names import ZIMAGE_NAME_MAP
from sglang.multimodal_gen.pipelines.zimage import ZImagePipeline
from sglang.multimodal_gen.runtime.request import GenerationRequest

logger = logging.getLogger(__name__)

LORA_TARGETS = ("all", "transformer")


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None``/``"auto"`` -> bf16 on CUDA, fp32 elsewhere; names -> ``torch.dtype``.

    Raises:
        ValueError: unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(table)} or 'auto'")
    return table[dtype]


def build_lora_manager(transformer: torch.nn.Module, lora_dirs: Sequence[str] = ()):
    """The LoRA manager over the transformer's LoRA-able layers, or ``None`` when the LoRA
    runtime (``sglang.multimodal_gen.lora.manager``) is not installed in this build."""
    try:
        from sglang.multimodal_gen.lora.manager import LoRAManager
    except ImportError:
        logger.warning("LoRA runtime not available: LoRA requests will be refused")
        return None
    return LoRAManager(
        {"transformer": transformer},
        ZIMAGE_NAME_MAP,
        allowed_roots=list(lora_dirs) or None,
    )


class DiTOffloader:
    """Keeps a module's parameters in pinned host memory between commands (``--dit-cpu-offload``).

    :meth:`onload` moves every parameter to the execution device; :meth:`offload` points it back
    at its host buffer, copying the device values into that buffer first when the command may
    have changed them (LoRA merge/unmerge/commit). Only parameters move: small LoRA tensors and
    merge snapshots stay where the LoRA runtime put them (on the device).
    """

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.module = module
        self.device = device
        self.params = [p for p in module.parameters()]
        self.host = []
        for p in self.params:
            buf = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=True)
            buf.copy_(p.data)
            self.host.append(buf)
        self.on_device = True
        self.offload(dirty=False)

    def onload(self) -> None:
        if self.on_device:
            return
        for p, buf in zip(self.params, self.host):
            p.data = buf.to(self.device, non_blocking=True)
        torch.cuda.synchronize(self.device)
        self.on_device = True

    def offload(self, dirty: bool) -> None:
        if not self.on_device:
            return
        for p, buf in zip(self.params, self.host):
            if dirty:
                buf.copy_(p.data, non_blocking=True)
        if dirty:
            torch.cuda.synchronize(self.device)
        for p, buf in zip(self.params, self.host):
            p.data = buf
        self.on_device = False


# Commands after which the DiT weights are unchanged (a per-request composition restores them).
_READ_ONLY_OPS = ("generate", "list_loras", "noop")


class ModelRunner:
    """Pipeline + LoRA manager of one rank.

    Args:
        model_path: diffusers-format directory.
        device: this rank's device.
        dtype: parameter/compute dtype (``None``: see :func:`resolve_dtype`).
        tp_rank, tp_size: this rank's TP coordinates.
        lora_dirs: allowed roots for local LoRA paths.
        generator_device: device of the seeded ``torch.Generator`` (default: the execution
            device's type, as in diffusers' examples; ``"cpu"`` reproduces a CPU-seeded run).
        dit_cpu_offload: on CUDA, keep the DiT weights in pinned host memory between commands
            (:class:`DiTOffloader`); ignored on other devices.
    """

    def __init__(
        self,
        model_path: str,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        lora_dirs: Sequence[str] = (),
        generator_device: str | None = None,
        dit_cpu_offload: bool = False,
    ):
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.tp_rank = tp_rank
        self.pipeline = ZImagePipeline.from_pretrained(
            model_path,
            device=self.device,
            dtype=self.dtype,
            tp_rank=tp_rank,
            tp_size=tp_size,
            load_vae=(tp_rank == 0),
        )
        self.generator_device = generator_device or (
            str(self.device) if self.device.type == "cuda" else self.device.type
        )
        self.lora_manager = build_lora_manager(self.pipeline.transformer, lora_dirs)
        self.offloader = None
        if dit_cpu_offload and self.device.type == "cuda":
            self.offloader = DiTOffloader(self.pipeline.transformer, self.device)

    @property
    def spatial_factor(self) -> int:
        return self.pipeline.spatial_factor

    def info(self) -> dict:
        return {"spatial_factor": self.spatial_factor, "dtype": str(self.dtype)}

    # ------------------------------------------------------------------ commands
    def execute(self, op: str, kwargs: dict) -> Any:
        """Run command ``op`` (a method name below) with ``kwargs``.

        Raises:
            ValueError: unknown command; else whatever the command raises.
        """
        fn = getattr(self, f"cmd_{op}", None)
        if fn is None:
            raise ValueError(f"unknown engine command {op!r}")
        if self.offloader is None or op == "noop":
            return fn(**kwargs)
        self.offloader.onload()
        try:
            return fn(**kwargs)
        finally:
            self.offloader.offload(dirty=op not in _READ_ONLY_OPS)

    def _manager(self):
        if self.lora_manager is None:
            raise InvalidRequestError(
                "LoRA is not available in this build (sglang.multimodal_gen.lora.manager missing)",
                param="lora",
            )
        return self.lora_manager

    def cmd_generate(self, req: GenerationRequest, progress: bool | None = None):
        """Returns uint8 ``[n, H, W, 3]`` on rank 0, ``None`` on other ranks."""
        gen = torch.Generator(self.generator_device).manual_seed(int(req.seed))
        kwargs = dict(
            prompt=req.prompt,
            negative_prompt=req.negative_prompt,
            height=req.height,
            width=req.width,
            num_inference_steps=req.num_inference_steps,
            guidance_scale=float(req.guidance_scale),
            generator=gen,
            num_images=req.num_images,
            output_type="np",
            progress=progress if self.tp_rank == 0 else False,
        )
        if req.lora is not None:
            with self._manager().use_composition(list(req.lora)):
                return self.pipeline(**kwargs)
        return self.pipeline(**kwargs)

    def cmd_set_lora(self, nicknames, paths, targets, strengths, merge_mode=None):
        return self._manager().set_lora(nicknames, paths, targets, strengths, merge_mode)

    def cmd_unset_lora(self, target="all"):
        return self._manager().unset_lora(target)

    def cmd_unload_lora(self, nickname):
        return self._manager().unload_adapter(nickname)

    def cmd_merge_lora_weights(self, target="all"):
        return self._manager().merge(target)

    def cmd_unmerge_lora_weights(self, target="all"):
        return self._manager().unmerge(target)

    def cmd_list_loras(self):
        if self.lora_manager is None:
            return {"loaded": [], "active": {}, "available": False}
        return self.lora_manager.list_loras()

    def cmd_noop(self):
        return None
