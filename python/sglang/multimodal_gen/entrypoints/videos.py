"""``/v1/videos``: asynchronous video jobs, in the shape of OpenAI's video API (and SGLang's).

``POST /v1/videos`` validates the request, queues one generation on the server's scheduler and
answers at once with a job object ``{id, object: "video", status, progress, ...}``;
``GET /v1/videos/{id}`` polls it, ``GET /v1/videos/{id}/content`` returns the MP4 once
``status`` is ``completed``, ``GET /v1/videos`` lists the jobs and ``DELETE /v1/videos/{id}``
removes one (a queued job is dropped before it runs). A completed job's ``step_cache`` gives the
counts of its step caching (``null`` without). Jobs live in memory: their number and the
bytes of their videos are bounded (the oldest finished jobs go first) and finished jobs expire.
A job survives its client's disconnect; failures are reported in the job as an OpenAI error
object.

``input_reference`` (OpenAI's name) is the request's input image: a file part of the form, or in
a JSON body base64 / a data URL / an allowed URL (or ``{"image_url": ...}``); it becomes the
engine request's ``image``, decoded with the server's image bounds (:mod:`.input_images`), and a
model that takes no image refuses it (400 naming ``input_reference``).

Every check a request can fail runs before the job exists: the values, the store's room, and
(by the scheduler, as it queues the generation) the adapters its ``lora`` names; a refused
request creates nothing. A job belongs to the key that created it (:class:`~.auth.Principal`):
another key gets 404 for it and does not see it in the list, the admin key sees every job;
without keys every job is everyone's.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from sglang.multimodal_gen.entrypoints.auth import ANONYMOUS, Principal
from sglang.multimodal_gen.entrypoints.http_body import (
    MAX_BODY_BYTES,
    parse_form_with_files,
    parse_json_body,
)
from sglang.multimodal_gen.entrypoints.input_images import body_limit, decode_inputs, http_field
from sglang.multimodal_gen.entrypoints.openai_errors import describe_exception
from sglang.multimodal_gen.entrypoints.protocol import (
    _Strict,
    default_size,
    parse_size,
    sampling_params,
    with_declared_fields,
)
from sglang.multimodal_gen.entrypoints.request_log import logger as request_logger
from sglang.multimodal_gen.entrypoints.request_log import lora_summary, record_of
from sglang.multimodal_gen.entrypoints.routing import RouteContext, principal_of
from sglang.multimodal_gen.errors import InvalidRequestError, NotFoundError, SGLangError
from sglang.multimodal_gen.image_inputs import ImageBudget
from sglang.multimodal_gen.outputs import STEP_CACHE_INFO, encode_video

__all__ = ["VideoGenerationRequest", "VideoJobStore", "add_video_routes"]


class _InputReference(_Strict):
    """OpenAI's object form of ``input_reference``: an image URL (a data URL, or a URL of an
    allowed host); ``file_id`` (OpenAI's file store) is not offered here."""

    image_url: str | None = None
    file_id: str | None = None


class _VideoGenerationBody(_Strict):
    """Body of ``POST /v1/videos``: OpenAI's fields (``prompt``, ``model``, ``size``,
    ``seconds``, ``input_reference``: in a JSON body base64 text, a data URL or
    ``{"image_url": ...}``; in a form a file part), plus every declared generation field of
    video models
    (:func:`~.protocol.with_declared_fields`: ``num_frames``, ``fps``, ``seed``,
    ``negative_prompt``, ``guidance_scale``, ``num_inference_steps``, ``lora``, and the
    families' own)."""

    prompt: str
    model: str | None = None
    size: str | None = None
    seconds: str | int | float | None = None
    input_reference: str | _InputReference | None = None


VideoGenerationRequest = with_declared_fields(_VideoGenerationBody, "VideoGenerationRequest")


class VideoJobError(SGLangError):
    """``GET /v1/videos/{id}/content`` of a job that has no video (yet)."""

    status_code = 409
    error_type = "invalid_request_error"


@dataclass
class VideoJob:
    """One job; :meth:`as_dict` is its JSON form."""

    id: str
    model: str
    prompt: str
    size: str
    seconds: str
    num_frames: int
    fps: int
    seed: int
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "queued"
    completed_at: int | None = None
    error: dict | None = None
    content: bytes | None = None
    future: Future | None = None
    total_steps: int | None = None  # denoising steps of the job (its progress' 100 %)
    steps_done: Callable[[Future], float | None] | None = None  # the scheduler's count
    owner: str | None = None  # the creating key's owner id (auth.key_owner); None: no key
    # the request's step-cache counts once completed (outputs.STEP_CACHE_INFO); None: not (yet)
    # known, or no step caching
    step_cache: dict | None = None

    def progress(self, status: str) -> int:
        """0-100: 100 once completed; while running, the share of its denoising steps done
        (at most 99: decoding and encoding follow the last step)."""
        if status == "completed":
            return 100
        if status != "in_progress":
            return 0
        if self.future is not None and self.future.done():
            return 99  # denoised; the video is being encoded
        if not self.total_steps or self.steps_done is None:
            return 0
        done = self.steps_done(self.future)
        return 0 if done is None else min(99, int(100 * done / self.total_steps))

    def as_dict(self) -> dict[str, Any]:
        status = self.status
        if status == "queued" and self.future is not None:
            if self.future.running() or (self.future.done() and not self.future.cancelled()):
                status = "in_progress"  # running, or generated and being encoded
        return {
            "id": self.id,
            "object": "video",
            "model": self.model,
            "status": status,
            "progress": self.progress(status),
            "created_at": self.created_at,
            "completed_at": self.completed_at,
            "expires_at": None,
            "size": self.size,
            "seconds": self.seconds,
            "num_frames": self.num_frames,
            "fps": self.fps,
            "seed": self.seed,
            "prompt": self.prompt,
            "error": self.error,
            "step_cache": self.step_cache,
        }


class VideoJobStore:
    """Jobs by id, bounded in count and video bytes; finished jobs expire after ``ttl_s``.

    Every lookup is on behalf of a viewer (a :class:`~.auth.Principal`; ``None``: no key): a job
    it may not see (:meth:`~.auth.Principal.may_see`) is as unknown to it as one that never
    existed.

    Args:
        max_jobs: jobs kept at once; a new job first evicts the oldest finished one, and is
            refused (HTTP 400) when every kept job is still queued or running.
        max_bytes: total MP4 bytes kept; the oldest finished jobs go first.
        ttl_s: seconds a finished job is kept.
    """

    def __init__(self, max_jobs: int = 256, max_bytes: int = 2 << 30, ttl_s: float = 3600.0):
        self.max_jobs, self.max_bytes, self.ttl_s = max_jobs, max_bytes, ttl_s
        self._jobs: OrderedDict[str, VideoJob] = OrderedDict()
        self._lock = threading.Lock()

    def _finished(self, job: VideoJob) -> bool:
        return job.status in ("completed", "failed")

    def _expire_locked(self) -> None:
        now = time.time()
        for jid in [j.id for j in self._jobs.values() if self._finished(j)]:
            job = self._jobs[jid]
            if job.completed_at is not None and now - job.completed_at > self.ttl_s:
                del self._jobs[jid]
        while len(self._jobs) >= self.max_jobs or self._bytes_locked() > self.max_bytes:
            old = next((j.id for j in self._jobs.values() if self._finished(j)), None)
            if old is None:
                break
            del self._jobs[old]

    def _bytes_locked(self) -> int:
        return sum(len(j.content or b"") for j in self._jobs.values())

    def _check_room_locked(self) -> None:
        self._expire_locked()
        if len(self._jobs) >= self.max_jobs:
            raise InvalidRequestError(f"{self.max_jobs} video jobs are still running; retry later")

    def check_room(self) -> None:
        """Raise ``InvalidRequestError`` (``param=None``) when full of running jobs (what
        :meth:`add` would raise), before anything is queued."""
        with self._lock:
            self._check_room_locked()

    def add(self, job: VideoJob) -> None:
        """Keep ``job``. Raises ``InvalidRequestError`` (``param=None``) when full of running
        jobs."""
        with self._lock:
            self._check_room_locked()
            self._jobs[job.id] = job

    def get(self, job_id: str, viewer: Principal | None = None) -> VideoJob:
        """The job (``NotFoundError`` naming ``video_id`` when unknown, expired, or not
        ``viewer``'s)."""
        with self._lock:
            self._expire_locked()
            job = self._jobs.get(job_id)
        if job is None or not (viewer or ANONYMOUS).may_see(job.owner):
            raise NotFoundError(f"video job {job_id!r} not found", param="video_id")
        return job

    def list(self, viewer: Principal | None = None) -> list[VideoJob]:
        """The jobs ``viewer`` may see, oldest first."""
        viewer = viewer or ANONYMOUS
        with self._lock:
            self._expire_locked()
            return [j for j in self._jobs.values() if viewer.may_see(j.owner)]

    def delete(self, job_id: str, viewer: Principal | None = None) -> VideoJob:
        """Remove a job ``viewer`` may see (``NotFoundError`` otherwise); a queued job is dropped
        before it runs."""
        job = self.get(job_id, viewer)
        if job.future is not None:
            job.future.cancel()  # a queued job is dropped; a running one finishes unseen
        with self._lock:
            self._jobs.pop(job_id, None)
        return job

    def finish(self, job: VideoJob, content: bytes | None, error: dict | None) -> None:
        with self._lock:
            job.content, job.error = content, error
            job.status = "completed" if error is None else "failed"
            job.completed_at = int(time.time())
            self._expire_locked()


def _frames_for(req: Any, fps: int) -> int | None:
    """``num_frames`` when given, else ``round(seconds * fps) + 1`` (``seconds`` checked when
    given), else ``None`` (the model's default). The resolved request then brings the count to
    the model's form, and the job reports the frames and seconds it will produce."""
    seconds = None
    if req.seconds is not None:
        try:
            seconds = float(req.seconds)
        except ValueError:
            raise InvalidRequestError(
                f"seconds must be a number, got {req.seconds!r}", param="seconds"
            ) from None
        if not 0 < seconds <= 60:
            raise InvalidRequestError(f"seconds must be in (0, 60], got {seconds}", param="seconds")
    if req.num_frames is not None:
        return req.num_frames
    if seconds is None:
        return None
    return int(round(seconds * fps)) + 1


def add_video_routes(
    app: FastAPI, ctx: RouteContext, store: VideoJobStore | None = None
) -> VideoJobStore:
    """Register the ``/v1/videos`` routes on ``app``; returns the job store.

    On an image model every route answers 400 naming the model's modality (``param="model"``).
    """
    store = store or VideoJobStore()
    spec, scheduler = ctx.spec, ctx.scheduler
    modality, model_id = spec.outputs, ctx.model_id

    def need_video_model() -> None:
        if modality != "video":
            raise InvalidRequestError(
                f"{model_id} is an {modality} model; use /v1/images/generations", param="model"
            )

    @app.post("/v1/videos")
    async def create_video(request: Request):
        need_video_model()
        content_type = request.headers.get("content-type", "")
        takes_image = "image" in spec.inputs
        # room for an input image only where the model takes one
        limit = body_limit(ctx.image_limits, content_type) if takes_image else MAX_BODY_BYTES
        raw = await ctx.read_body(request, limit)
        if content_type.lower().startswith("multipart/form-data"):  # the openai client's form
            req, parts = await run_in_threadpool(
                parse_form_with_files, raw, content_type, VideoGenerationRequest,
                {"input_reference": False}, limit=limit,
            )  # fmt: skip
            refs = [v for _, v in parts.get("input_reference", [])]
        else:
            req = await run_in_threadpool(parse_json_body, raw, VideoGenerationRequest, limit=limit)
            refs = [] if req.input_reference is None else [_reference_text(req.input_reference)]
        del raw
        ctx.check_model(req.model)
        if refs and not takes_image:  # before anything is decoded
            raise InvalidRequestError(
                f"{model_id} takes no input image (its inputs: {', '.join(spec.inputs)}); "
                "send the request without input_reference",
                param="input_reference",
            )
        image = None
        if refs:
            image = await run_in_threadpool(
                decode_inputs, refs, "input_reference", ctx.image_limits,
                ImageBudget(ctx.image_limits), model_max=spec.limits.max_input_images,
                allowed_hosts=ctx.image_url_hosts,
            )  # fmt: skip
        record = record_of(request)
        fps = req.fps if req.fps is not None else int(spec.defaults.fps or 16)
        if fps < 1 or fps > 120:
            raise InvalidRequestError(f"fps must be in [1, 120], got {fps}", param="fps")
        num_frames = _frames_for(req, fps)
        size = default_size(spec) if req.size is None else parse_size(req.size, spec)
        # the request resolved once, here: every value rule, before anything is queued
        try:
            params = sampling_params(req, spec, size, num_frames=num_frames, fps=fps, image=image)
        except InvalidRequestError as e:
            raise http_field(e, {"image": "input_reference"}) from None
        job = VideoJob(
            id=f"video_{secrets.token_hex(12)}", model=model_id, prompt=req.prompt,
            size=f"{params.width}x{params.height}",
            seconds=f"{(params.num_frames - 1) / params.fps:g}",  # what will be produced
            num_frames=params.num_frames, fps=params.fps, seed=params.seed,
            total_steps=params.num_inference_steps,
            steps_done=getattr(scheduler, "steps_done_for", None),
            owner=principal_of(request).owner,
        )  # fmt: skip
        record.note(
            model=model_id, size=job.size, steps=params.num_inference_steps,
            n=params.num_outputs_per_prompt, frames=params.num_frames,
            lora=lora_summary(params.lora), video_id=job.id,
            prompt=params.prompt, negative_prompt=params.negative_prompt,
        )  # fmt: skip
        # every check before the job exists: the store's room, then (the scheduler, as it
        # queues) the adapters; a refusal leaves no job behind
        store.check_room()
        # the answer is the job as created ("queued"): a fast engine may finish it before this
        # handler runs again, and the answer should not depend on that race
        created = job.as_dict()
        timing = record.timing()
        job.future = scheduler.submit_generation(params, timing=timing)
        try:
            store.add(job)
        except BaseException:
            job.future.cancel()
            raise
        request_id = record.request_id

        def done(fut: Future) -> None:
            if fut.cancelled():
                return
            try:
                video = fut.result()[0]
                job.step_cache = getattr(video, "info", {}).get(STEP_CACHE_INFO)
                content = encode_video(video, fmt="mp4")
            except BaseException as e:
                _, body, _ = describe_exception(e)
                body["error"]["message"] = ctx.public_paths.scrub(body["error"]["message"])
                store.finish(job, None, body["error"])
            else:
                store.finish(job, content, None)
            request_logger.info(
                "video_id=%s request_id=%s status=%s queued_s=%s compute_s=%s",
                job.id, request_id, job.status,
                _seconds(timing.queued_s), _seconds(timing.compute_s),
            )  # fmt: skip

        job.future.add_done_callback(done)
        return JSONResponse(created)

    @app.get("/v1/videos")
    async def list_videos(request: Request):
        need_video_model()
        jobs = store.list(principal_of(request))
        return JSONResponse({"object": "list", "data": [j.as_dict() for j in jobs]})

    @app.get("/v1/videos/{video_id}")
    async def get_video(video_id: str, request: Request):
        need_video_model()
        return JSONResponse(store.get(video_id, principal_of(request)).as_dict())

    @app.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str, request: Request):
        need_video_model()
        job = store.get(video_id, principal_of(request))
        if job.status != "completed" or job.content is None:
            raise VideoJobError(
                f"video job {video_id!r} is {job.as_dict()['status']}; its content is available "
                "once it is completed",
                param="video_id",
            )
        return Response(job.content, media_type="video/mp4")

    @app.delete("/v1/videos/{video_id}")
    async def delete_video(video_id: str, request: Request):
        need_video_model()
        job = store.delete(video_id, principal_of(request))
        return JSONResponse({"id": job.id, "object": "video.deleted", "deleted": True})

    return store


def _reference_text(ref: str | _InputReference) -> str:
    """The image text of a JSON ``input_reference`` (a string, or the object's ``image_url``).

    Raises:
        InvalidRequestError: naming ``input_reference``; an object without ``image_url``.
    """
    if isinstance(ref, str):
        return ref
    if ref.image_url is None:
        raise InvalidRequestError(
            "input_reference: give the image itself (a file part, base64, or "
            '{"image_url": "data:image/png;base64,..."}); file_id is not offered here',
            param="input_reference",
        )
    return ref.image_url


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
