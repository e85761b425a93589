"""Where a job's model and layout come from: the model directory (a path, a Hub id downloaded
into or found in the Hugging Face cache, or the embedded default), the transformer's other weights
(``--transformer-path`` / ``--transformer-weights-path`` / ``--quantization``), the device, the
parallel layout for the model's head count, and the engine arguments a ``ServerArgs`` implies
(shared by the engine and follower nodes).
"""

from __future__ import annotations

import logging
import os

import torch

from sglang.multimodal_gen import errors as errors_mod
from sglang.multimodal_gen.hub import (
    HubUnavailableError,
    is_repo_id,
    model_snapshot,
    transformer_snapshot,
)

logger = logging.getLogger(__name__)


def job_kwargs(server_args) -> dict:
    """The :class:`~sglang.multimodal_gen.runtime.engine.DiffusionEngine` arguments that shape a
    job (model, device, dtype, layout, kernels), from a ``ServerArgs``: the same for the engine on
    node 0 and for the ranks of follower nodes."""
    return dict(
        model_path=server_args.model_path,
        revision=getattr(server_args, "revision", None),
        transformer_path=getattr(server_args, "transformer_path", None),
        transformer_weights_path=getattr(server_args, "transformer_weights_path", None),
        quantization=getattr(server_args, "quantization", None),
        step_cache=getattr(server_args, "step_cache", None),
        tp_size=server_args.tp_size,
        sp_degree=server_args.sp_degree,
        ulysses_degree=server_args.ulysses_degree,
        ring_degree=server_args.ring_degree,
        cfg_degree=2 if server_args.enable_cfg_parallel else 1,
        device=server_args.device,
        dtype=server_args.dtype,
        dit_cpu_offload=bool(getattr(server_args, "dit_cpu_offload", False)),
        attention_backend=server_args.attention_backend,
        enable_torch_compile=server_args.enable_torch_compile,
        float32_matmul_precision=getattr(server_args, "float32_matmul_precision", "highest"),
        cpu_gemm_backend=getattr(server_args, "cpu_gemm_backend", "auto"),
    )


def layout_for_model(model_path, tp_size, sp_degree, ulysses_degree, ring_degree, cfg_degree):
    """The parallel layout for this model's head count (see ``configs.parallel``)."""
    from sglang.multimodal_gen.configs.parallel import resolve_layout
    from sglang.multimodal_gen.models.registry import family_for_model

    heads = None
    if (ulysses_degree, ring_degree) == (None, None) and (sp_degree or 1) > 1:
        family = family_for_model(model_path)
        heads = family.attention_heads(family.read_config(model_path))
    return resolve_layout(
        tp_size=tp_size,
        sp_degree=sp_degree,
        ulysses_degree=ulysses_degree,
        ring_degree=ring_degree,
        enable_cfg_parallel=int(cfg_degree) == 2,
        heads=heads,
    )


def check_device(device: str | None) -> str:
    """The execution device for ``device`` (``None``: CUDA when available, else the CPU).

    Raises:
        InvalidRequestError: ``param="device"``; not a device name, or a device this machine
            does not have (CUDA without a GPU or a CUDA build of torch, ``cuda:N`` past the GPU
            count, ``mps`` off macOS...).
    """
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise errors_mod.InvalidRequestError(
            f"--device {device!r} is not a device; use cpu, cuda or cuda:N", param="device"
        ) from None
    if dev.type == "cpu":
        return device
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "torch was built without CUDA" if torch.version.cuda is None else "no GPU found"
            raise errors_mod.InvalidRequestError(
                f"--device {device!r}: CUDA is not available on this machine ({why}); use "
                "--device cpu",
                param="device",
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise errors_mod.InvalidRequestError(
                f"--device {device!r}: this machine has {count} GPU(s) (cuda:0 to "
                f"cuda:{count - 1})",
                param="device",
            )
        return device
    backend = getattr(torch, dev.type, None)
    available = getattr(backend, "is_available", None)
    if callable(available) and available():
        return device
    raise errors_mod.InvalidRequestError(
        f"--device {device!r}: {dev.type} is not available on this machine; use cpu or cuda",
        param="device",
    )


def resolve_model_path(model_path: str | None, revision: str | None = None) -> tuple[str, str]:
    """``(directory, served name)``: the embedded default model (built once) for ``None``, a
    directory as given, else a Hub repo id (``owner/name``) at ``revision``, downloaded into the
    Hugging Face cache when needed (:func:`~sglang.multimodal_gen.hub.model_snapshot`: only the
    files the engine reads; offline, the cached snapshot).

    Raises:
        FileNotFoundError: not a directory, and not a Hub id that is cached or can be downloaded
            (one line naming the repo id, the cache folder and the command that downloads it).
    """
    if model_path is None:
        if revision:
            logger.warning("--revision %s ignored: no --model-path (the embedded model)", revision)
        from sglang.multimodal_gen.models.default_model import (
            default_model_name,
            default_model_path,
        )

        return default_model_path(), default_model_name()
    if os.path.isdir(model_path):
        if revision:
            logger.warning("--revision %s ignored: %s is a local directory", revision, model_path)
    elif is_repo_id(model_path):
        model_path = model_snapshot(model_path, revision)
    else:
        raise FileNotFoundError(
            f"model path {model_path!r} is not a directory and is not in the local Hugging Face "
            "cache (it is not a Hub repo id, owner/name, either)"
        )
    return model_path, os.path.basename(os.path.normpath(model_path))


def resolve_transformer_source(path: str | None, flag: str, folder: bool = False) -> str | None:
    """The local path of a ``--transformer-path`` / ``--transformer-weights-path`` value: an
    existing local path as given (``~`` expanded), else a Hub repo id (``owner/name``: its
    top-level configs and safetensors) or one file of a Hub repo
    (``owner/name/file.safetensors``), downloaded into the Hugging Face cache when not there
    (:func:`~sglang.multimodal_gen.hub.transformer_snapshot`; ``HF_*`` variables honoured).

    Args:
        path: the flag's value (``None``: ``None``).
        flag: the flag's name, for the errors.
        folder: the value must be a folder (``--transformer-path``).

    Raises:
        FileNotFoundError: not a local path and not a Hub id that is cached or can be downloaded
            (one line naming the flag); a file where a folder is needed.
    """
    if path is None:
        return None
    local = os.path.expanduser(path)
    if not os.path.exists(local):
        parts = path.split("/")
        try:
            if is_repo_id(path):
                local = transformer_snapshot(path)
            elif (
                len(parts) > 2 and path.endswith(".safetensors") and is_repo_id("/".join(parts[:2]))
            ):
                filename = "/".join(parts[2:])
                local = os.path.join(transformer_snapshot("/".join(parts[:2]), filename), filename)
            else:
                raise FileNotFoundError(
                    f"{flag} {path!r} does not exist (not a local path, nor a Hub repo id "
                    "owner/name or owner/name/file.safetensors)"
                )
        except HubUnavailableError as e:
            raise FileNotFoundError(f"{flag}: {e}") from None
    if folder and not os.path.isdir(local):
        raise FileNotFoundError(
            f"{flag} {path!r} is not a folder (a transformer folder holds config.json and its "
            "safetensors; use --transformer-weights-path for a weights file)"
        )
    return local


def weight_options(
    transformer_path: str | None = None,
    transformer_weights_path: str | None = None,
    quantization: str | None = None,
):
    """The primary transformer's :class:`~sglang.multimodal_gen.models.loader.WeightOptions`
    for the flags (paths resolved by :func:`resolve_transformer_source`), or ``None`` when no
    flag is given (the model's own ``transformer/``).

    Raises:
        ValueError: exclusive or unknown flags (:func:`~..configs.server_args.check_weight_flags`);
        FileNotFoundError: see :func:`resolve_transformer_source`.
    """
    from sglang.multimodal_gen.configs.server_args import check_weight_flags
    from sglang.multimodal_gen.models.loader import WeightOptions

    check_weight_flags(transformer_path, transformer_weights_path, quantization)
    if not (transformer_path or transformer_weights_path or quantization):
        return None
    return WeightOptions(
        transformer_path=resolve_transformer_source(
            transformer_path, "--transformer-path", folder=True
        ),
        transformer_weights_path=resolve_transformer_source(
            transformer_weights_path, "--transformer-weights-path"
        ),
        quantization=quantization,
    )
