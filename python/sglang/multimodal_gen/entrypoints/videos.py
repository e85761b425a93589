"""``/v1/videos``: asynchronous video jobs, in the shape of OpenAI's video API (and SGLang's).

``POST /v1/videos`` validates the request, queues one generation on the server's scheduler and
answers at once with a job object ``{id, object: "video", status, progress, ...}``;
``GET /v1/videos/{id}`` polls it, ``GET /v1/videos/{id}/content`` returns the MP4 once
``status`` is ``completed``, ``GET /v1/videos`` lists the jobs and ``DELETE /v1/videos/{id}``
removes one (a queued job is dropped before it runs). Jobs live in memory: their number and the
bytes of their videos are bounded (the oldest finished jobs go first) and finished jobs expire.
A job survives its client's disconnect; failures are reported in the job as an OpenAI error
object.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StrictFloat, StrictInt, StrictStr

from sglang.multimodal_gen.entrypoints.http_body import parse_form_body
from sglang.multimodal_gen.entrypoints.openai_errors import describe_exception
from sglang.multimodal_gen.entrypoints.protocol import LoRASpec, parse_size
from sglang.multimodal_gen.errors import InvalidRequestError, NotFoundError, SGLangError
from sglang.multimodal_gen.lora.requests import validate_composition
from sglang.multimodal_gen.outputs import encode_video

__all__ = ["VideoGenerationRequest", "VideoJobStore", "add_video_routes"]

Number = StrictInt | StrictFloat


class VideoGenerationRequest(BaseModel):
    """Body of ``POST /v1/videos`` (OpenAI's fields plus the engine's)."""

    model_config = ConfigDict(extra="forbid")

    prompt: StrictStr
    model: StrictStr | None = None
    size: StrictStr | None = None
    seconds: StrictStr | Number | None = None
    num_frames: StrictInt | None = None
    fps: StrictInt | None = None
    seed: StrictInt | None = None
    negative_prompt: StrictStr | None = None
    guidance_scale: Number | None = None
    guidance_scale_2: Number | None = None
    num_inference_steps: StrictInt | None = None
    max_sequence_length: StrictInt | None = None
    lora: LoRASpec | list[LoRASpec] | None = None


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
        }


class VideoJobStore:
    """Jobs by id, bounded in count and video bytes; finished jobs expire after ``ttl_s``.

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

    def add(self, job: VideoJob) -> None:
        """Keep ``job``. Raises ``InvalidRequestError`` (``param=None``) when full of running
        jobs."""
        with self._lock:
            self._expire_locked()
            if len(self._jobs) >= self.max_jobs:
                raise InvalidRequestError(
                    f"{self.max_jobs} video jobs are still running; retry later"
                )
            self._jobs[job.id] = job

    def get(self, job_id: str) -> VideoJob:
        """The job (``NotFoundError`` naming ``video_id`` when unknown or expired)."""
        with self._lock:
            self._expire_locked()
            job = self._jobs.get(job_id)
        if job is None:
            raise NotFoundError(f"video job {job_id!r} not found", param="video_id")
        return job

    def list(self) -> list[VideoJob]:
        with self._lock:
            self._expire_locked()
            return list(self._jobs.values())

    def delete(self, job_id: str) -> VideoJob:
        job = self.get(job_id)
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


def _frames_for(req: VideoGenerationRequest, fps: int, default_frames: int) -> tuple[int, str]:
    """``(num_frames, seconds)``: ``num_frames`` when given, else ``seconds * fps + 1`` (both are
    validated when given), else the model's default."""
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
        if req.num_frames < 1:
            raise InvalidRequestError("num_frames must be >= 1", param="num_frames")
        return req.num_frames, f"{(req.num_frames - 1) / fps:g}"
    if seconds is None:
        return default_frames, f"{(default_frames - 1) / fps:g}"
    return int(round(seconds * fps)) + 1, f"{seconds:g}"


def add_video_routes(
    app: FastAPI,
    *,
    scheduler: Any,
    read_body: Callable[[Request], Awaitable[bytes]],
    parse_body: Callable[[bytes, type[BaseModel]], Any],
    check_model: Callable[[str | None], None],
    limits: Any,
    defaults: dict,
    modality: str,
    model_id: str,
    request_factory: Callable[..., Any],
    store: VideoJobStore | None = None,
) -> VideoJobStore:
    """Register the ``/v1/videos`` routes on ``app``; returns the job store.

    On an image model every route answers 400 naming the model's modality (``param="model"``).
    """
    store = store or VideoJobStore()

    def need_video_model() -> None:
        if modality != "video":
            raise InvalidRequestError(
                f"{model_id} is an {modality} model; use /v1/images/generations", param="model"
            )

    @app.post("/v1/videos")
    async def create_video(request: Request):
        need_video_model()
        raw = await read_body(request)
        content_type = request.headers.get("content-type", "")
        if content_type.lower().startswith("multipart/form-data"):  # the openai client's form
            req = await parse_form_body(raw, content_type, VideoGenerationRequest)
        else:
            req = parse_body(raw, VideoGenerationRequest)
        check_model(req.model)
        fps = req.fps if req.fps is not None else int(defaults.get("fps") or 16)
        if fps < 1 or fps > 120:
            raise InvalidRequestError(f"fps must be in [1, 120], got {fps}", param="fps")
        num_frames, seconds = _frames_for(req, fps, int(defaults.get("num_frames") or 1))
        if req.size is None:
            width, height = int(defaults.get("width", 832)), int(defaults.get("height", 480))
        else:
            width, height = parse_size(req.size, limits)
        kwargs: dict[str, Any] = dict(
            prompt=req.prompt, height=height, width=width, num_frames=num_frames, fps=fps,
            seed=req.seed if req.seed is not None else secrets.randbits(63),
            negative_prompt=req.negative_prompt, num_inference_steps=req.num_inference_steps,
            guidance_scale=req.guidance_scale, guidance_scale_2=req.guidance_scale_2,
            max_sequence_length=req.max_sequence_length,
        )  # fmt: skip
        if req.lora is not None:
            kwargs["lora"] = validate_composition(req.lora, "lora")
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        # every value rule, before anything is queued (the engine checks again)
        request_factory(**kwargs).with_defaults(defaults).validate(
            limits.spatial_factor, limits.request_limits(defaults)
        )
        job = VideoJob(
            id=f"video_{secrets.token_hex(12)}", model=model_id, prompt=req.prompt,
            size=f"{width}x{height}", seconds=seconds, num_frames=num_frames, fps=fps,
            seed=kwargs["seed"],
            total_steps=req.num_inference_steps or int(defaults.get("num_inference_steps") or 0),
            steps_done=getattr(scheduler, "steps_done_for", None),
        )  # fmt: skip
        store.add(job)
        # the answer is the job as created ("queued"): a fast engine may finish it before this
        # handler runs again, and the answer should not depend on that race
        created = job.as_dict()
        try:
            job.future = scheduler.submit_video(**kwargs)
        except BaseException:
            store.delete(job.id)
            raise

        def done(fut: Future) -> None:
            if fut.cancelled():
                return
            try:
                frames = fut.result()[0]
                content = encode_video(frames, fps, "mp4")
            except BaseException as e:
                _, body, _ = describe_exception(e)
                store.finish(job, None, body["error"])
                return
            store.finish(job, content, None)

        job.future.add_done_callback(done)
        return JSONResponse(created)

    @app.get("/v1/videos")
    async def list_videos():
        need_video_model()
        return JSONResponse({"object": "list", "data": [j.as_dict() for j in store.list()]})

    @app.get("/v1/videos/{video_id}")
    async def get_video(video_id: str):
        need_video_model()
        return JSONResponse(store.get(video_id).as_dict())

    @app.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str):
        need_video_model()
        job = store.get(video_id)
        if job.status != "completed" or job.content is None:
            raise VideoJobError(
                f"video job {video_id!r} is {job.as_dict()['status']}; its content is available "
                "once it is completed",
                param="video_id",
            )
        return Response(job.content, media_type="video/mp4")

    @app.delete("/v1/videos/{video_id}")
    async def delete_video(video_id: str):
        need_video_model()
        job = store.delete(video_id)
        return JSONResponse({"id": job.id, "object": "video.deleted", "deleted": True})

    return store
