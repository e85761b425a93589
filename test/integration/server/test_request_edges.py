"""The same invalid request through the three edges gives the same error.

A request enters as an HTTP body (``POST /v1/images/generations``: 400 with ``error.param`` and
``error.message``), as ``sglang generate`` arguments (exit code 2 and the one line
``sglang generate: error: <message>``) or as a Python call (``engine.generate`` raising
``InvalidRequestError`` with ``.param`` and ``.message``). Each edge builds one ``SamplingParams``
and resolves it against the served model's ``RequestSpec``, so a value is refused with the same
field and the same words wherever it enters. The model is the embedded demo (``DiffusionEngine()``
without a path), loaded once for the module.

The cases are spelled the same on every edge and do not depend on the server's own bounds
(``--max-steps`` makes the step range ``[1, 1000]`` over HTTP where the Python API and the CLI
say ``>= 1``: that difference is asserted on its own, below). Over HTTP the height is part of
``size``: its refusal names ``size``, with the same rule.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sglang.cli.generate import main as generate_main
from sglang.multimodal_gen.configs.server_args import ServerArgs
from sglang.multimodal_gen.configs.wan import WanSamplingParams
from sglang.multimodal_gen.entrypoints.http_server import create_app
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.runtime import DiffusionEngine, SamplingParams

PROMPT = "a red circle on a blue background, top left"
MAX_SEED = 2**63 - 1

#: (id, the request's fields, the CLI flags, the HTTP body's fields, param, message)
CASES = [
    (
        "negative-guidance",
        dict(guidance_scale=-1.0),
        ["--guidance-scale", "-1"],
        dict(guidance_scale=-1.0),
        "guidance_scale",
        "guidance_scale must be a finite number >= 0, got -1.0",
    ),
    (
        "long-prompt",
        dict(prompt="x" * 20001),
        ["--prompt", "x" * 20001],
        dict(prompt="x" * 20001),
        "prompt",
        "prompt is longer than 20000 characters (20001)",
    ),
    (
        "negative-seed",
        dict(seed=-1),
        ["--seed", "-1"],
        dict(seed=-1),
        "seed",
        f"seed must be an integer in [0, {MAX_SEED}] or null, got -1",
    ),
    (
        "undeclared-field",
        dict(guidance_scale_2=3.0),
        ["--guidance-scale-2", "3"],
        dict(guidance_scale_2=3.0),
        "guidance_scale_2",
        None,  # the spec's own sentence (listing the model's parameters), the same everywhere
    ),
]
IDS = [c[0] for c in CASES]


@pytest.fixture(scope="module")
def engine():
    with DiffusionEngine(device="cpu") as eng:  # no path: the embedded demo model
        yield eng


@pytest.fixture(scope="module")
def client(engine):
    app = create_app(engine, ServerArgs(), shutdown_engine=False)
    with TestClient(app) as c:  # runs the lifespan: the scheduler thread
        yield c


def _python(engine, fields: dict) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as e:
        engine.generate(**{"prompt": PROMPT, **fields})
    return e.value


def _http(client, fields: dict) -> dict:
    r = client.post("/v1/images/generations", json={"prompt": PROMPT, "seed": 1, **fields})
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    return err


def _cli(flags: list[str], tmp_path, capsys) -> tuple[int, str]:
    out = tmp_path / "out.png"
    argv = ["--prompt", PROMPT, "--seed", "1", "--device", "cpu", "--no-progress"]
    code = generate_main([*argv, *flags, "--output-path", str(out)])  # later flags win
    err = capsys.readouterr().err
    assert not out.exists()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return code, lines[0]


def test_the_demo_model_is_what_the_edges_serve(engine, client):
    assert engine.spec.params_class.__name__ == "ZImageSamplingParams"
    assert "guidance_scale_2" not in engine.spec.params_class.field_names()
    assert client.app.state.spec.params_class is engine.spec.params_class
    assert engine.spec.spatial_factor == 8  # the demo's VAE (x4) and 2x2 patches


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_same_error_on_every_edge(engine, client, tmp_path, capsys, case):
    _, fields, flags, body, param, message = case
    py = _python(engine, fields)
    if message is None:  # the undeclared field: the spec's words, which name the model
        message = py.message
        assert message.startswith(f"{param} is not a parameter of Z-Image models; their parameters")
    assert (py.param, py.message) == (param, message)
    code, line = _cli(flags, tmp_path, capsys)
    assert (code, line) == (2, f"sglang generate: error: {message}")
    http = _http(client, body)
    assert (http["param"], http["message"]) == (param, message)


def test_a_request_object_gives_the_same_errors(engine):
    """``engine.generate(SamplingParams(...))`` and a family's class (converted to the model's)
    are refused as the keyword form is."""
    for _, fields, _, _, param, message in CASES:
        if param == "guidance_scale_2":  # not a field of the common class: another family's
            params = WanSamplingParams(prompt=PROMPT, **fields)
        else:
            params = SamplingParams(**{"prompt": PROMPT, **fields})
        with pytest.raises(InvalidRequestError) as e:
            engine.generate(params)
        assert e.value.param == param
        assert e.value.message == (message or _python(engine, fields).message)


def test_height_not_a_multiple_of_the_spatial_factor(engine, client, tmp_path, capsys):
    """The Python API and the CLI name ``height``; HTTP spells the height in ``size`` and names
    that, with the same rule (multiples of the model's spatial factor)."""
    f = engine.spec.spatial_factor
    bad = 4 * f + f // 2  # 36 for the demo's factor 8
    message = f"height must be a positive multiple of {f}, got {bad}"
    py = _python(engine, dict(height=bad))
    assert (py.param, py.message) == ("height", message)
    assert _cli(["--height", str(bad)], tmp_path, capsys) == (
        2,
        f"sglang generate: error: {message}",
    )
    http = _http(client, dict(size=f"64x{bad}"))
    assert http["param"] == "size"
    assert http["message"].startswith(
        f"invalid size '64x{bad}': width and height must be multiples of {f} for this model"
    )


def test_zero_steps_differ_only_by_the_servers_bound(engine, client, tmp_path, capsys):
    """``num_inference_steps=0``: the same field everywhere; the server adds its ``--max-steps``
    bound to the range it states (the model itself has none)."""
    py = _python(engine, dict(num_inference_steps=0))
    assert (py.param, py.message) == (
        "num_inference_steps",
        "num_inference_steps must be an integer >= 1, got 0",
    )
    assert _cli(["--num-inference-steps", "0"], tmp_path, capsys) == (
        2,
        "sglang generate: error: num_inference_steps must be an integer >= 1, got 0",
    )
    http = _http(client, dict(num_inference_steps=0))
    top = ServerArgs().max_inference_steps
    assert (http["param"], http["message"]) == (
        "num_inference_steps",
        f"num_inference_steps must be an integer in [1, {top}], got 0",
    )
