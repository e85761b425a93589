"""No answer carries the server's paths (real uvicorn, fake engine with the real LoRA loader):
``/v1/models`` shows the served name, ``list_loras`` and the admin answers adapter paths relative
to their ``--lora-dir``, errors neither the LoRA roots nor the model or Hub cache directories."""

from __future__ import annotations

import httpx
from fixtures.server import FakeEngine, assert_envelope, running_server, write_lora_file
from sglang.multimodal_gen.configs.server_args import ServerArgs

ADMIN = {"Authorization": "Bearer admin"}


def test_no_server_path_in_any_answer(tmp_path, monkeypatch):
    secret = tmp_path / "srv-secret"
    loras, model, cache = secret / "loras", secret / "models" / "Z-Image", secret / "hf"
    write_lora_file(str(loras / "a.safetensors"), seed=1)
    write_lora_file(str(loras / "two" / "x.safetensors"), seed=2)
    write_lora_file(str(loras / "two" / "y.safetensors"), seed=3)
    model.mkdir(parents=True)
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    args = ServerArgs(model_path=str(model), model_type="diffusion", lora_dirs=[str(loras)],
                      admin_api_key="admin")  # fmt: skip
    answers = []
    with running_server(FakeEngine(lora_dirs=[str(loras)]), args) as (url, _, _):
        r = httpx.get(f"{url}/v1/models")
        card = r.json()["data"][0]
        assert card["root"] == card["id"] == "fake-zimage"
        answers.append(r.text)
        answers.append(httpx.get(f"{url}/v1/models/{model}").text)  # an alias: still the name
        body = {"lora_nickname": "a", "lora_path": str(loras / "a.safetensors")}
        r = httpx.post(f"{url}/v1/set_lora", json=body, headers=ADMIN, timeout=30)
        assert r.status_code == 200, r.text
        answers.append(r.text)
        r = httpx.get(f"{url}/v1/list_loras")
        assert r.json()["loaded"]["a"]["path"] == "a.safetensors"
        answers.append(r.text)
        for lora_path, needle in (
            (str(loras / "two"), "'two' holds several .safetensors files"),
            ("owner/not-cached", "<hf-cache>"),
        ):
            body = {"lora_nickname": "b", "lora_path": lora_path}
            r = httpx.post(f"{url}/v1/set_lora", json=body, headers=ADMIN, timeout=30)
            err = assert_envelope(r, 400, param="lora_path")
            assert needle in err["message"], err
            answers.append(r.text)
    for text in answers:
        assert str(secret) not in text, text
