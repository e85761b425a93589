"""DMD few-step sampling: the sampler of Distribution-Matching-Distilled flow models (FastVideo's
FastWan2.1 / FastWan2.2), as a scheduler any family's ``prepare_timesteps`` can return.

A DMD student does not integrate an ODE: at each of a few fixed timesteps it predicts the clean
latents and starts over from them with fresh noise. The published algorithm (FastVideo,
``fastvideo/pipelines/stages/denoising.py`` ``DmdDenoisingStage.forward``, with
``fastvideo/models/utils.py`` ``pred_noise_to_pred_video`` and
``fastvideo/models/schedulers/scheduling_flow_match_euler_discrete.py`` ``add_noise``)::

    timesteps  t_0 > t_1 > ... > t_{n-1}      (FastWan2.1 / FastWan2.2: 1000, 757, 522)
    sigma(t)   the entry of a flow-matching training table nearest to t (below)
    step i:    v   = DiT(x_i, t_i)                          (no classifier-free guidance)
               x0  = x_i - sigma(t_i) v
               x_{i+1} = (1 - sigma(t_{i+1})) x0 + sigma(t_{i+1}) eps_i,  eps_i ~ N(0, I) fresh
    last step: the result is x0

The DiT gets the integer timestep ``t_i`` itself. The sigma table is the one of FastVideo's
``FlowMatchEulerDiscreteScheduler(shift=8.0)``, which the DMD stage builds for itself whatever
the model directory's scheduler (FastWan2.2-TI2V-5B ships diffusers' ``UniPCMultistepScheduler``
with ``flow_shift`` 5.0, unused by the DMD path): ``u_k = k / 1000`` for ``k = 1000 ... 1``,
``sigma_k = 8 u_k / (1 + 7 u_k)``, ``t_k = 1000 sigma_k``, all in float32, and ``sigma(t)`` is
``sigma_k`` of the ``k`` whose ``t_k`` is nearest to ``t``. For the published timesteps:
``sigma(1000) = 1``, ``sigma(757) = 28/37 = 0.756757`` (``u = 0.28``), ``sigma(522) = 12/23 =
0.521739`` (``u = 0.12``).

The fresh noise. FastVideo draws it with ``torch.randn`` from the request's generator (the one
that drew the initial latents) in its loop layout ``[B, T, C, H, W]``, the whole batch at once,
before each re-noise. :func:`dmd_noise` draws it the same way: float32 from the request's
generator, in ``[B, T, C, H, W]`` order for video latents ``[B, C, T, H, W]`` (then permuted
back), as it is for any other latent shape. So the noise depends only on the request's seed, the
latent shape and the step: every tensor-/sequence-parallel rank (each with its own generator
seeded from the same request seed, drawing the same shapes in the same order) draws the same
noise, and a request batched with others draws what it would alone (each request has its own
generator). FastVideo draws in the prediction's dtype (bfloat16 under its autocast) and on the
generator's device; here it is float32, so only a float32 run repeats FastVideo's numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from sglang.multimodal_gen.configs.sampling_params import RequestLimits, RequestSpec
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.models.model_dir import ModelLoadError

__all__ = [
    "DMD_TABLE_SHIFT",
    "DMD_TIMESTEPS",
    "DMD_TIMESTEPS_KEY",
    "DMDRequestSpec",
    "DMDScheduler",
    "dmd_noise",
    "dmd_request_spec",
    "dmd_sigmas",
    "dmd_step",
    "dmd_timesteps",
    "refuse_guidance",
]

#: FastVideo's ``dmd_denoising_steps`` of FastWan2.1-T2V and FastWan2.2-TI2V-5B
#: (``fastvideo/configs/pipelines/wan.py``: ``FastWan2_1_T2V_480P_Config``,
#: ``FastWan2_2_TI2V_5B_Config``).
DMD_TIMESTEPS: tuple[int, ...] = (1000, 757, 522)
#: The shift of the sigma table (``DmdDenoisingStage.__init__``: ``shift=8.0``).
DMD_TABLE_SHIFT = 8.0
#: Entries of the sigma table (``num_train_timesteps``).
DMD_TRAIN_TIMESTEPS = 1000
#: The optional ``model_index.json`` key with a directory's own timesteps (FastVideo's pipeline
#: config field name; the published directories do not carry it: :data:`DMD_TIMESTEPS` applies).
DMD_TIMESTEPS_KEY = "dmd_denoising_steps"

Noise = Callable[[torch.Size], torch.Tensor]


def dmd_timesteps(pipeline_config: dict[str, Any], where: str = "model_index.json") -> tuple:
    """The DMD timesteps of a model directory: ``pipeline_config[DMD_TIMESTEPS_KEY]`` when set,
    else :data:`DMD_TIMESTEPS`.

    Args:
        pipeline_config: the non-component entries of ``model_index.json``.
        where: the file, for messages.

    Returns:
        A tuple of ints, strictly decreasing, each in ``[1, 1000]``.

    Raises:
        ModelLoadError: the value is not a non-empty, strictly decreasing list of integers in
            ``[1, 1000]`` (the message names the key).
    """
    value = pipeline_config.get(DMD_TIMESTEPS_KEY)
    if value is None:
        return DMD_TIMESTEPS
    ok = isinstance(value, list | tuple) and len(value) > 0
    ok = ok and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ok = ok and all(1 <= t <= DMD_TRAIN_TIMESTEPS for t in value)
    ok = ok and all(a > b for a, b in zip(value, value[1:]))
    if not ok:
        raise ModelLoadError(
            f"{where}: {DMD_TIMESTEPS_KEY} must be a non-empty, strictly decreasing list of "
            f"integers in [1, {DMD_TRAIN_TIMESTEPS}], got {value!r}"
        )
    return tuple(value)


def dmd_sigmas(
    timesteps: Sequence[float],
    shift: float = DMD_TABLE_SHIFT,
    num_train_timesteps: int = DMD_TRAIN_TIMESTEPS,
) -> list[float]:
    """``sigma(t)`` of each timestep: the nearest entry of the shifted flow-matching table (see
    the module docstring; FastVideo's ``pred_noise_to_pred_video`` / ``add_noise`` lookup).

    Args:
        timesteps: in ``[0, num_train_timesteps]``.

    Returns:
        Python floats (float32 values), one per timestep.
    """
    n = int(num_train_timesteps)
    u = torch.arange(n, 0, -1, dtype=torch.float32) / n
    sigmas = shift * u / (1 + (shift - 1) * u)
    table = (sigmas * n).double()
    out = []
    for t in timesteps:
        k = int(torch.argmin((table - float(t)).abs()))
        out.append(float(sigmas[k]))
    return out


def dmd_step(
    sample: torch.Tensor,
    velocity: torch.Tensor,
    sigma: float,
    sigma_next: float | None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """One DMD step: ``x0 = sample - sigma * velocity``; the last step (``sigma_next`` ``None``)
    returns ``x0``, the others ``(1 - sigma_next) * x0 + sigma_next * noise``.

    Args:
        sample: ``x_t``, any shape, float.
        velocity: the flow prediction ``v`` at ``x_t`` (the DiT's output), same shape.
        sigma: ``sigma(t)`` of this step; sigma_next: of the next step, or ``None`` (last step).
        noise: fresh standard normal noise, the shape of ``sample`` (required unless last).

    Returns:
        float32, the shape of ``sample``.

    Raises:
        ValueError: ``noise`` missing or of another shape on a step that is not the last.
    """
    x0 = sample.float() - sigma * velocity.float()
    if sigma_next is None:
        return x0
    if noise is None or noise.shape != sample.shape:
        got = None if noise is None else tuple(noise.shape)
        raise ValueError(f"dmd_step: noise of shape {tuple(sample.shape)} needed, got {got}")
    return (1 - sigma_next) * x0 + sigma_next * noise.to(x0.device, torch.float32)


def dmd_noise(
    shape: Sequence[int], generator: torch.Generator, device: torch.device | str
) -> torch.Tensor:
    """Fresh standard normal noise of ``shape``, float32 on ``device``, drawn from ``generator``
    (on the generator's device) as FastVideo's DMD loop draws it: a 5-D video shape ``[B, C, T,
    H, W]`` is drawn as ``[B, T, C, H, W]`` and permuted back; other shapes as they are."""
    shape = tuple(int(s) for s in shape)
    gdev = generator.device
    if len(shape) == 5:
        b, c, t, h, w = shape
        eps = torch.randn((b, t, c, h, w), generator=generator, device=gdev, dtype=torch.float32)
        eps = eps.permute(0, 2, 1, 3, 4)
    else:
        eps = torch.randn(shape, generator=generator, device=gdev, dtype=torch.float32)
    return eps.to(device)


class DMDScheduler:
    """The DMD sampler behind diffusers' scheduler interface (``timesteps``, ``sigmas``,
    ``set_begin_index``, ``step(model_output, t, sample, return_dict=False)``), so that the staged
    loop runs it unchanged; one per request (it counts its steps and holds the request's noise).

    Args:
        timesteps: the steps' timesteps (what the DiT gets), decreasing.
        noise: ``fn(shape) -> float32 tensor``, fresh noise per call (:func:`dmd_noise` bound to
            the request's generator: :meth:`for_request`).
        device: where ``timesteps`` live.
        shift: the sigma table's shift (:data:`DMD_TABLE_SHIFT`).

    Attributes:
        timesteps: float32 ``[n]``; sigmas: float32 ``[n + 1]``, ``sigma(t_i)`` then 0 (the
            result of the last step is ``x0``).
    """

    order = 1

    def __init__(
        self,
        timesteps: Sequence[int],
        noise: Noise,
        device: torch.device | str = "cpu",
        shift: float = DMD_TABLE_SHIFT,
    ):
        if len(timesteps) == 0:
            raise ValueError("DMDScheduler: no timesteps")
        self.timesteps = torch.tensor([float(t) for t in timesteps], device=device)
        self.sigmas = torch.tensor([*dmd_sigmas(timesteps, shift), 0.0], dtype=torch.float32)
        self.noise = noise
        self.config: dict[str, Any] = {"dmd_timesteps": list(timesteps), "shift": shift}
        self._index = 0

    @classmethod
    def for_request(
        cls,
        timesteps: Sequence[int],
        num_steps: int,
        generator: torch.Generator,
        device: torch.device | str,
    ) -> DMDScheduler:
        """The scheduler of one request: the first ``num_steps`` timesteps, the noise from the
        request's ``generator``.

        Raises:
            InvalidRequestError: ``num_steps`` not in ``[1, len(timesteps)]``
                (``param="num_inference_steps"``).
        """
        if not 1 <= num_steps <= len(timesteps):
            raise InvalidRequestError(
                f"num_inference_steps must be in [1, {len(timesteps)}] for this DMD-distilled "
                f"model (its timesteps: {list(timesteps)}), got {num_steps}",
                param="num_inference_steps",
            )
        noise = partial(dmd_noise, generator=generator, device=device)
        return cls(timesteps[:num_steps], noise, device)

    @property
    def step_index(self) -> int:
        """The step the next :meth:`step` call runs."""
        return self._index

    def set_begin_index(self, begin_index: int = 0) -> None:
        self._index = int(begin_index)

    def step(self, model_output, timestep, sample, return_dict: bool = False):
        """``(x_next,)``: :func:`dmd_step` of step :attr:`step_index` (``timestep`` is that
        step's; the last step returns ``x0``).

        Raises:
            ValueError: ``return_dict`` true, or more steps than timesteps.
        """
        if return_dict:
            raise ValueError("DMDScheduler.step returns a tuple (return_dict=False)")
        i, n = self._index, len(self.timesteps)
        if i >= n:
            raise ValueError(f"DMDScheduler: step {i} of a {n}-step schedule")
        last = i == n - 1
        sigma, nxt = float(self.sigmas[i]), None if last else float(self.sigmas[i + 1])
        noise = None if last else self.noise(sample.shape)
        self._index += 1
        return (dmd_step(sample, model_output, sigma, nxt, noise),)


@dataclasses.dataclass(frozen=True)
class DMDRequestSpec(RequestSpec):
    """The :class:`RequestSpec` of a DMD model: :meth:`resolve` also refuses classifier-free
    guidance (:func:`refuse_guidance`), so the request fails where it is resolved (HTTP 400
    before it is queued) rather than when it runs."""

    def resolve(self, params):
        """As :meth:`RequestSpec.resolve`, then :func:`refuse_guidance`.

        Raises:
            InvalidRequestError: as :meth:`RequestSpec.resolve`; ``guidance_scale > 1``.
        """
        resolved = super().resolve(params)
        refuse_guidance(resolved)
        return resolved


def dmd_request_spec(spec: RequestSpec, num_timesteps: int) -> DMDRequestSpec:
    """``spec`` of a DMD model (a :class:`DMDRequestSpec`): defaults ``num_inference_steps =
    num_timesteps`` and ``guidance_scale = 1`` (no CFG), at most ``num_timesteps`` steps (fewer
    run the first timesteps: :meth:`DMDScheduler.for_request`)."""
    defaults = spec.defaults.replace(num_inference_steps=num_timesteps, guidance_scale=1.0)
    bound = {f.name: None for f in dataclasses.fields(RequestLimits)}
    bound["max_inference_steps"] = num_timesteps
    values = {f.name: getattr(spec, f.name) for f in dataclasses.fields(RequestSpec)}
    values["defaults"] = defaults
    return DMDRequestSpec(**values).with_limits(RequestLimits(**bound))


def refuse_guidance(params: Any, model: str = "this DMD-distilled model") -> None:
    """Refuse classifier-free guidance: a DMD student samples without it (FastVideo's DMD stage
    runs the DiT once per step on the prompt alone and never reads the guidance scale); a
    ``guidance_scale`` above 1 would double the DiT calls for frames the model was not trained
    to make, so it is an error rather than silently ignored. Values up to 1 mean no CFG.

    Raises:
        InvalidRequestError: ``guidance_scale > 1`` (``param="guidance_scale"``).
    """
    w = getattr(params, "guidance_scale", None)
    if w is not None and w > 1.0:
        raise InvalidRequestError(
            f"guidance_scale {w:g}: {model} samples without classifier-free guidance; use "
            "guidance_scale 1 (the default)",
            param="guidance_scale",
        )
