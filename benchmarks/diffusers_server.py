"""A plain diffusers server: the baseline ``benchmarks/bench_serving.py`` measures ours against.

What a user writes before reaching for a serving engine: one diffusers ``DiffusionPipeline``
loaded at start-up, a FastAPI app with the OpenAI ``POST /v1/images/generations`` route, and a
``threading.Lock`` around the pipeline call (a pipeline is not safe to call from two threads at
once). The route is a plain ``def``, so FastAPI runs it on its thread pool: requests wait for the
lock, run one at a time, one image per pipeline call, no batching. The images are encoded as PNG
with PIL's defaults and returned base64 in the OpenAI envelope.

Accepted body fields (the subset ``bench_serving.py`` sends): ``prompt``, ``n``, ``size``
(``"WxH"``), ``seed``, ``num_inference_steps``, ``guidance_scale``, ``negative_prompt``,
``response_format`` (``"b64_json"`` only). A bad value answers 400 with an OpenAI error body
naming the field.

Usage::

    python benchmarks/diffusers_server.py --model-path DIR --port 30001 [--device cpu]
"""

from __future__ import annotations

import argparse
import base64
import io
import threading
import time

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict


class GenerationBody(BaseModel):
    """The OpenAI image-generation request, as far as this baseline reads it."""

    model_config = ConfigDict(extra="ignore")

    prompt: str
    n: int = 1
    size: str = "1024x1024"
    seed: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    response_format: str = "b64_json"


def _error(message: str, param: str) -> JSONResponse:
    """A 400 answer in the OpenAI error envelope."""
    body = {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": None,
        }
    }
    return JSONResponse(body, status_code=400)


def parse_size(size: str) -> tuple[int, int]:
    """``"WxH"`` -> ``(width, height)`` in pixels.

    Raises:
        ValueError: not two positive integers joined by ``x``.
    """
    parts = size.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"size must look like 512x512, got {size!r}")
    return int(parts[0]), int(parts[1])


def create_app(pipe, device: str = "cpu") -> FastAPI:
    """The FastAPI app serving ``pipe`` (a loaded diffusers pipeline) on ``device``."""
    app = FastAPI()
    lock = threading.Lock()

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.post("/v1/images/generations")
    def generations(body: GenerationBody):
        try:
            width, height = parse_size(body.size)
        except ValueError as e:
            return _error(str(e), "size")
        if not 1 <= body.n <= 8:
            return _error(f"n must be in [1, 8], got {body.n}", "n")
        if body.response_format != "b64_json":
            return _error("only response_format b64_json is served here", "response_format")
        kwargs = {"height": height, "width": width, "num_images_per_prompt": body.n}
        if body.num_inference_steps is not None:
            kwargs["num_inference_steps"] = body.num_inference_steps
        if body.guidance_scale is not None:
            kwargs["guidance_scale"] = body.guidance_scale
        if body.negative_prompt is not None:
            kwargs["negative_prompt"] = body.negative_prompt
        if body.seed is not None:
            kwargs["generator"] = torch.Generator(device).manual_seed(body.seed)
        with lock, torch.inference_mode():
            images = pipe(body.prompt, **kwargs).images
        data = []
        for image in images:
            buf = io.BytesIO()
            image.save(buf, format="PNG")
            data.append({"b64_json": base64.b64encode(buf.getvalue()).decode("ascii")})
        return {"created": int(time.time()), "data": data}

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn
    from diffusers import DiffusionPipeline

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="a diffusers pipeline directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30001)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args(argv)
    pipe = DiffusionPipeline.from_pretrained(
        args.model_path, torch_dtype=getattr(torch, args.dtype)
    )
    pipe.to(args.device)
    pipe.set_progress_bar_config(disable=True)
    uvicorn.run(create_app(pipe, args.device), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
