"""Helpers for the HTTP server tests: a fake engine, a real uvicorn in a thread, small clients.

:class:`FakeEngine` implements the ``DiffusionEngine`` API (SPEC "Engine") with deterministic images:
each image is a pure function of the request fields and of the adapter composition it ran with
(names, strengths and the content hash of each adapter's tensors). Tests compute the expected image
with :func:`fake_reference_image` and so can tell exactly which composition a response used. LoRA
files are read with the project's real loader (``lora.loading.load_lora_state_dict``), so path
containment, Hub-cache lookups and their error messages are the real ones.

The fake also checks the scheduler's contract: a second thread entering any engine method while
another call runs raises ``AssertionError`` (reported as a 500 and caught by the tests).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import threading
import time
from typing import Any

import httpx
import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file
from sglang.multimodal_gen.configs.sampling_params import (
    RequestLimits,
    RequestSpec,
    SamplingParams,
)
from sglang.multimodal_gen.configs.zimage import ZImageSamplingParams
from sglang.multimodal_gen.errors import EngineDeadError, NotFoundError

#: What the fake engine serves: a Z-Image model's request spec (its family's fields and
#: defaults; no model bound on the side below the server's own 2048).
FAKE_SPEC = RequestSpec(
    "zimage",
    "Z-Image",
    ZImageSamplingParams,
    ZImageSamplingParams(
        height=1024,
        width=1024,
        num_inference_steps=8,
        guidance_scale=0.0,
        max_sequence_length=512,
        cfg_normalization=0.0,
        cfg_truncation=1.0,
    ),
    RequestLimits(max_image_size=4096, max_sequence_length=1024),
    spatial_factor=16,
)


def fake_params(**fields: Any) -> SamplingParams:
    """A request of the fake engine's model (``FAKE_SPEC.params``; unset fields keep the
    model's defaults, an unset seed stays unset)."""
    return FAKE_SPEC.params(**fields)


def fake_reference_image(
    req: Any, composition: list[tuple[str, float, str]], index: int
) -> Image.Image:
    """The image :class:`FakeEngine` returns for ``req`` under ``composition``.

    Args:
        req: a ``SamplingParams`` (resolved or not: unset fields take the fake model's
            defaults; the seed is the request's).
        composition: ``[(nickname, strength, content_hash), ...]`` in application order.
        index: image index within the request.
    """
    d = FAKE_SPEC.defaults

    def value(name: str) -> Any:
        v = getattr(req, name)
        return getattr(d, name) if v is None else v

    key = json.dumps(
        [
            req.prompt,
            req.negative_prompt,
            value("height"),
            value("width"),
            value("num_inference_steps"),
            float(value("guidance_scale")),
            req.seed,
            [[n, float(s), h] for n, s, h in composition],
            index,
        ]
    )
    digest = hashlib.sha256(key.encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    pixels = rng.integers(0, 256, size=(value("height"), value("width"), 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def _content_hash(state_dict: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(state_dict):
        h.update(k.encode())
        h.update(state_dict[k].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class FakeEngine:
    """A stand-in for ``DiffusionEngine`` with the same methods and properties.

    Args:
        delay_s: seconds each ``generate`` sleeps (lets tests build up a queue).
        lora_dirs: allowed roots for local adapter paths (``None`` = unrestricted).
    """

    model_name = "fake-zimage"
    spec: RequestSpec = FAKE_SPEC
    lora_targets = ("all", "transformer")

    @property
    def spatial_factor(self) -> int:
        return self.spec.spatial_factor

    @property
    def defaults(self) -> dict:
        return self.spec.as_dict()

    @property
    def modality(self) -> str:
        return self.spec.outputs

    def __init__(self, delay_s: float = 0.0, lora_dirs: list[str] | None = None):
        self.delay_s = delay_s
        self.lora_dirs = lora_dirs
        self.loaded: dict[str, tuple[str, str]] = {}  # nickname -> (path, content hash)
        self.active: list[tuple[str, float]] = []
        self.merged = False
        self.alive = True
        self.calls: list[str] = []
        self.generate_log: list[tuple[Any, list]] = []
        self._guard = threading.Lock()
        self.release = threading.Event()
        self.release.set()

    # -- contract check: one thread at a time ------------------------------------------------
    @contextlib.contextmanager
    def _exclusive(self, name: str):
        if not self._guard.acquire(blocking=False):
            raise AssertionError(f"engine.{name} entered while another engine call runs")
        try:
            if not self.alive:
                raise EngineDeadError("fake engine is dead")
            self.calls.append(name)
            yield
        finally:
            self._guard.release()

    def composition_of(
        self, names_strengths: list[tuple[str, float]]
    ) -> list[tuple[str, float, str]]:
        out = []
        for name, strength in names_strengths:
            if name not in self.loaded:
                raise NotFoundError(f"LoRA adapter {name!r} is not loaded", param="lora")
            out.append((name, float(strength), self.loaded[name][1]))
        return out

    # -- DiffusionEngine API ----------------------------------------------------------------
    def generate(
        self, params: SamplingParams | None = None, progress: bool | None = None, **fields: Any
    ) -> list[Image.Image]:
        if params is None:
            params = self.spec.params(**fields)
        elif fields:
            raise TypeError(f"unexpected arguments next to a SamplingParams: {sorted(fields)}")
        req = self.spec.resolve(params)  # as the engine: a resolved request is taken as is
        with self._exclusive("generate"):
            if req.prompt == "raise internal error":
                raise RuntimeError("secret internal detail /opt/model.py line 3")
            comp = self.composition_of(req.lora if req.lora is not None else self.active)
            self.release.wait(timeout=30)
            if self.delay_s:
                time.sleep(self.delay_s)
            self.generate_log.append((req, comp))
            return [fake_reference_image(req, comp, i) for i in range(req.num_outputs_per_prompt)]

    def set_lora(
        self,
        lora_nickname,
        lora_path=None,
        target="all",
        strength=1.0,
        merge_mode=None,
        trusted=False,
    ):
        from sglang.multimodal_gen.lora.loading import load_lora_state_dict
        from sglang.multimodal_gen.lora.requests import SetLoRAArgs, normalize_set_lora

        with self._exclusive("set_lora"):
            if isinstance(lora_nickname, SetLoRAArgs):  # normalised by the HTTP layer
                args = lora_nickname
            else:
                args = normalize_set_lora(
                    lora_nickname, lora_path, target, strength, merge_mode,
                    valid_targets=self.lora_targets,
                )  # fmt: skip
            names, paths, strengths = args.nicknames, args.paths, args.strengths
            new_loaded = dict(self.loaded)
            for name, path in zip(names, paths):
                if path is None:
                    if name not in new_loaded:
                        raise NotFoundError(
                            f"LoRA adapter {name!r} is not loaded", param="lora_nickname"
                        )
                    continue
                sd, _meta = load_lora_state_dict(path, None if trusted else self.lora_dirs)
                new_loaded[name] = (path, _content_hash(sd))
            self.loaded = new_loaded  # atomic: only after every adapter loaded
            self.active = [(n, float(s)) for n, s in zip(names, strengths)]
            return {"active": [n for n in names]}

    def unset_lora(self, target="all"):
        with self._exclusive("unset_lora"):
            self.active = []

    def unload_lora(self, nickname):
        with self._exclusive("unload_lora"):
            if nickname not in self.loaded:
                raise NotFoundError(
                    f"LoRA adapter {nickname!r} is not loaded", param="lora_nickname"
                )
            del self.loaded[nickname]
            self.active = [(n, s) for n, s in self.active if n != nickname]

    def merge_lora_weights(self, target="all"):
        with self._exclusive("merge_lora_weights"):
            self.merged = True

    def unmerge_lora_weights(self, target="all"):
        with self._exclusive("unmerge_lora_weights"):
            self.merged = False

    def list_loras(self) -> dict:
        with self._exclusive("list_loras"):
            return {
                "loaded": {n: {"path": p} for n, (p, _h) in sorted(self.loaded.items())},
                "active": {"all": [{"name": n, "strength": s} for n, s in self.active]},
                "merged": self.merged,
            }

    def is_alive(self) -> bool:
        return self.alive

    def shutdown(self) -> None:
        self.alive = False


# ---------------------------------------------------------------------------------------------
# LoRA files


def write_lora_file(path: str, seed: int, rank: int = 4, modules: int = 2) -> str:
    """Write a small PEFT-style LoRA safetensors file with random non-zero weights."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(modules):
        base = f"transformer.layers.{i}.attention.to_q"
        sd[f"{base}.lora_A.weight"] = torch.randn(rank, 32, generator=g)
        sd[f"{base}.lora_B.weight"] = torch.randn(32, rank, generator=g)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    save_file(sd, path)
    return path


# ---------------------------------------------------------------------------------------------
# server


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(engine: Any, server_args: Any = None, **app_kwargs):
    """Serve ``create_app(engine, server_args)`` with real uvicorn on 127.0.0.1:<free port>.

    Yields:
        ``(base_url, app, uvicorn_server)``. The server stops (gracefully) when the block exits;
        setting ``uvicorn_server.should_exit`` is what SIGTERM does.
    """
    import uvicorn
    from sglang.multimodal_gen.configs.server_args import ServerArgs
    from sglang.multimodal_gen.entrypoints.http_server import create_app
    from sglang.multimodal_gen.entrypoints.transport import uvicorn_config

    # listen before uvicorn starts: a port picked free and bound later could be taken meanwhile
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    port = sock.getsockname()[1]
    args = (server_args or ServerArgs()).replace(host="127.0.0.1", port=port)
    app = create_app(engine, args, **app_kwargs)
    # the server's own connection bounds (header/body timeouts, connection cap)
    config = uvicorn_config(app, args, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            sock.close()
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app, server
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()  # uvicorn closed it already unless it failed to start


def wait_until(cond: Any, what: str, timeout: float = 30.0) -> None:
    """Poll ``cond()`` every 10 ms until true; ``AssertionError(what)`` after ``timeout`` s.

    Tests synchronise on observable state this way, never on a fixed ``sleep`` (which a loaded
    machine outlasts)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def wait_not_accepting(url: str, timeout: float = 10.0) -> None:
    """Poll ``url/health`` until the server no longer accepts connections.

    "Not accepting" is every way a closing listener can answer a new connection: refused
    (``ConnectError``), or accepted by the kernel backlog and then reset or closed before or
    after the request was written (``WriteError``, ``ReadError``, ``RemoteProtocolError``). A
    timeout proves nothing (a loaded machine can be slow to answer), so it polls again.

    Raises:
        AssertionError: still answering after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(f"{url}/health", timeout=2)
        except (httpx.NetworkError, httpx.RemoteProtocolError):
            return
        except httpx.TimeoutException:
            pass
        assert time.monotonic() < deadline, "still accepting after shutdown began"
        time.sleep(0.05)


def assert_envelope(response: Any, status: int, param: str | None = "__any__") -> dict:
    """Assert an OpenAI error envelope with ``status``; return its ``error`` object."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]
    if param != "__any__":
        assert err["param"] == param, err
    return err


# ---------------------------------------------------------------------------------------------
# real tiny model


def write_zimage_lora(path: str, model_path: str, seed: int, modules=("to_q", "to_v"), peft=False):
    """A random non-zero LoRA for the tiny Z-Image's attention projections.

    ``peft=False``: one diffusers-format ``.safetensors`` file (``transformer.`` prefix) at
    ``path``; ``peft=True``: a PEFT folder (``adapter_model.safetensors`` +
    ``adapter_config.json`` with ``lora_alpha`` = 2 r) at ``path``.
    """
    cfg = json.load(open(os.path.join(model_path, "transformer", "config.json")))
    dim, n_layers, rank = cfg["dim"], cfg["n_layers"], 4
    g = torch.Generator().manual_seed(seed)
    sd = {}
    prefix = "base_model.model." if peft else "transformer."
    for i in range(n_layers):
        for m in modules:
            key = f"{prefix}layers.{i}.attention.{m}"
            sd[f"{key}.lora_A.weight"] = torch.randn(rank, dim, generator=g) * 0.2
            sd[f"{key}.lora_B.weight"] = torch.randn(dim, rank, generator=g) * 0.2
    if peft:
        os.makedirs(path, exist_ok=True)
        save_file(sd, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(
                {
                    "peft_type": "LORA",
                    "r": rank,
                    "lora_alpha": 2 * rank,
                    "target_modules": list(modules),
                },
                f,
            )
    else:
        save_file(sd, path)
    return path
