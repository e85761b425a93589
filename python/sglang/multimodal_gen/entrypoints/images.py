"""Images: PNG/JPEG/WebP encoding, the store behind ``response_format="url"``, and the routes
``POST /v1/images/generations`` (OpenAI Images API + seed, steps, guidance, negative_prompt,
lora, cache; the answer adds ``seed`` and, when the request ran with step caching, its
``step_cache`` counts), ``POST /v1/images/edits`` (the same with input images and a mask, as a multipart form as
OpenAI defines it or a JSON body with base64 images) and ``GET /v1/images/files/{name}``.

Both generation routes run the engine's ``generate`` command (:data:`~..engine_ops.OPS`, which
owns the generations path); the edits path is this module's (:data:`EDITS_PATH`).

A stored image belongs to the key that created it (:class:`~.auth.Principal`): another key gets
404 for it, the admin key gets every one; without keys every image is everyone's. Its link starts
with the server's configured base (:mod:`.public_url`), never with the request's ``Host``.
"""

from __future__ import annotations

import base64
import secrets
import threading
import time
from collections import OrderedDict

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from sglang.multimodal_gen.engine_ops import OPS
from sglang.multimodal_gen.entrypoints.auth import ANONYMOUS, Principal
from sglang.multimodal_gen.entrypoints.http_body import (
    MAX_BODY_BYTES,
    parse_form_with_files,
    parse_json_body,
)
from sglang.multimodal_gen.entrypoints.input_images import (
    body_limit,
    decode_inputs,
    http_field,
)
from sglang.multimodal_gen.entrypoints.metrics import ServerMetrics
from sglang.multimodal_gen.entrypoints.protocol import (
    ImageData,
    ImageEditRequest,
    ImageGenerationRequest,
    ImageGenerationResponse,
    ImageJob,
    image_job,
    size_for_input,
)
from sglang.multimodal_gen.entrypoints.request_log import lora_summary, record_of
from sglang.multimodal_gen.entrypoints.routing import RouteContext, principal_of
from sglang.multimodal_gen.errors import InvalidRequestError, NotFoundError
from sglang.multimodal_gen.image_inputs import ImageBudget
from sglang.multimodal_gen.outputs import IMAGE_FORMATS, STEP_CACHE_INFO, encode_image

#: The path of ``POST /v1/images/edits`` (it runs the ``generate`` command, as generations do).
EDITS_PATH = "/v1/images/edits"
#: The HTTP name of each engine request field the edits route spells otherwise (an engine error
#: naming ``mask_image`` reaches the client as ``mask``).
_EDIT_FIELDS = {"mask_image": "mask"}


class ImageStore:
    """In-memory store for ``response_format="url"``: random names, oldest dropped first,
    time-limited, each image visible to its owner only (:meth:`~.auth.Principal.may_see`).

    Args:
        capacity: images kept at most.
        max_bytes: encoded bytes kept at most (256 PNGs at 2048x2048 would be about 3 GB); the
            newest image is always kept.
        ttl_s: seconds an image stays available.
    """

    def __init__(self, capacity: int = 256, max_bytes: int = 1 << 30, ttl_s: float = 3600.0):
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        # name -> (bytes, media type, stored at, owner)
        self._items: OrderedDict[str, tuple[bytes, str, float, str | None]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, data: bytes, output_format: str, owner: str | None = None) -> str:
        """Store ``data`` for ``owner`` (a :attr:`~.auth.Principal.owner`); return its file name
        (``<random>.<ext>``)."""
        name = f"{secrets.token_urlsafe(18)}.{output_format}"
        with self._lock:
            self._items[name] = (data, IMAGE_FORMATS[output_format], time.monotonic(), owner)
            self._bytes += len(data)
            while len(self._items) > 1 and (
                len(self._items) > self.capacity or self._bytes > self.max_bytes
            ):
                self._bytes -= len(self._items.popitem(last=False)[1][0])
        return name

    def get(self, name: str, viewer: Principal | None = None) -> tuple[bytes, str] | None:
        """``(bytes, media_type)``, or ``None`` when unknown, expired or not ``viewer``'s
        (``None``: no owner, as a server without keys)."""
        with self._lock:
            item = self._items.get(name)
            if item is None or not (viewer or ANONYMOUS).may_see(item[3]):
                return None
            if time.monotonic() - item[2] > self.ttl_s:
                del self._items[name]
                self._bytes -= len(item[0])
                return None
            return item[0], item[1]


def add_image_routes(
    app: FastAPI, ctx: RouteContext, images: ImageStore, metrics: ServerMetrics
) -> None:
    """Register the image routes on ``app``: generations go through ``ctx.scheduler``; their
    images are encoded off the event loop and returned inline or kept in ``images``."""

    def need_image_model() -> None:
        modality = ctx.spec.outputs
        if modality != "image":  # before the values: their bounds are a video's
            raise InvalidRequestError(
                f"{ctx.model_id} is a {modality} model; use /v1/videos", param="model"
            )

    async def run_job(request: Request, job: ImageJob, t0: float) -> JSONResponse:
        """Queue ``job``, wait for its images, answer them inline or as links."""
        record = record_of(request)
        params = job.params
        record.note(
            model=ctx.model_id, size=job.size, steps=params.num_inference_steps,
            n=params.num_outputs_per_prompt, lora=lora_summary(params.lora),
            prompt=params.prompt, negative_prompt=params.negative_prompt,
        )  # fmt: skip
        future = ctx.scheduler.submit_generation(params, timing=record.timing())
        pil_images = await ctx.wait_for(future, request)

        def encode_all() -> list[bytes]:
            return [
                encode_image(img, job.output_format, job.output_compression) for img in pil_images
            ]

        blobs = await run_in_threadpool(encode_all)
        data = []
        owner = principal_of(request).owner
        base = ctx.public_url.base(request.scope)
        for blob in blobs:
            if job.response_format == "url":
                name = images.put(blob, job.output_format, owner)
                data.append(ImageData(url=f"{base}/v1/images/files/{name}"))
            else:
                data.append(ImageData(b64_json=base64.b64encode(blob).decode("ascii")))
        counts = getattr(pil_images[0], "info", {}) if pil_images else {}
        body = ImageGenerationResponse(
            created=int(time.time()),
            data=data,
            output_format=job.output_format,
            size=job.size,
            seed=job.params.seed,
            step_cache=counts.get(STEP_CACHE_INFO),
        ).model_dump(exclude_none=True)
        metrics.images.inc(len(data))
        metrics.e2e.observe(time.perf_counter() - t0)
        return JSONResponse(body)

    async def images_generations(request: Request):
        t0 = time.perf_counter()
        req = parse_json_body(await ctx.read_body(request), ImageGenerationRequest)
        ctx.check_model(req.model)
        need_image_model()
        # the request resolved once, here: defaults, every value rule, the seed drawn (so the
        # response can report it and the image can be reproduced)
        return await run_job(request, image_job(req, ctx.spec), t0)

    async def images_edits(request: Request):
        t0 = time.perf_counter()
        limits, spec = ctx.image_limits, ctx.spec
        content_type = request.headers.get("content-type", "")
        takes_image = spec.outputs == "image" and "image" in spec.inputs
        # room for input images only where the model takes them (else refused below, unread)
        limit = body_limit(limits, content_type) if takes_image else MAX_BODY_BYTES
        raw = await ctx.read_body(request, limit)
        if content_type.lower().startswith("multipart/form-data"):  # OpenAI's form
            req, parts = await run_in_threadpool(
                parse_form_with_files, raw, content_type, ImageEditRequest,
                {"image": True, "mask": False}, limit=limit, max_fields=limits.max_images + 64,
            )  # fmt: skip
            image_values = [v for _, v in parts.get("image", [])]
            mask_values = [v for _, v in parts.get("mask", [])]
        else:  # JSON: base64 text, a data URL, or a URL of an allowed host
            parts = None
            req = await run_in_threadpool(parse_json_body, raw, ImageEditRequest, limit=limit)
            image_values = [req.image] if isinstance(req.image, str) else list(req.image or [])
            mask_values = [] if req.mask is None else [req.mask]
        del raw
        ctx.check_model(req.model)
        need_image_model()
        # what the model takes, before anything is decoded
        if "image" not in spec.inputs:
            raise InvalidRequestError(
                f"{ctx.model_id} takes no input image (its inputs: {', '.join(spec.inputs)}); "
                "use /v1/images/generations",
                param="image",
            )
        if not image_values:
            raise InvalidRequestError("an edit needs an image (image)", param="image")
        if mask_values and "mask" not in spec.inputs:
            raise InvalidRequestError(
                f"{ctx.model_id} takes no mask (its inputs: {', '.join(spec.inputs)})",
                param="mask",
            )
        budget = ImageBudget(limits)  # one byte count for the images and the mask

        def decode_all(image_values, mask_values):
            common = dict(limits=limits, budget=budget, allowed_hosts=ctx.image_url_hosts)
            imgs = decode_inputs(
                image_values, "image", model_max=spec.limits.max_input_images, **common
            )
            masks = decode_inputs(mask_values, "mask", mask=True, **common)
            return imgs, (masks[0] if masks else None)

        decoded, mask = await run_in_threadpool(decode_all, image_values, mask_values)
        # the encoded bytes are not needed any more: not held while the job waits and runs
        del parts, image_values, mask_values
        # without a size: an image-to-image model keeps the input's size (OpenAI's "auto");
        # an edit model (an image required) makes the size its own rule gives, as from the CLI
        # and the Python API (Kontext's default, Qwen-Image-Edit's from the last image)
        auto = size_for_input(spec, *decoded[0].size)
        try:
            job = image_job(req, spec, auto, image=decoded, mask_image=mask)
        except InvalidRequestError as e:
            raise http_field(e, _EDIT_FIELDS) from None
        del req
        return await run_job(request, job, t0)

    generate = OPS["generate"]  # the op table owns the path
    app.add_api_route(generate.path, images_generations, methods=[generate.method])
    app.add_api_route(EDITS_PATH, images_edits, methods=["POST"])

    @app.get("/v1/images/files/{name}")
    async def image_file(name: str, request: Request):
        item = images.get(name, principal_of(request))
        if item is None:
            raise NotFoundError(f"image {name!r} does not exist or has expired", param="name")
        return Response(content=item[0], media_type=item[1])
