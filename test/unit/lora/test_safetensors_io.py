"""LoRA files and configs from the outside: checked before they are read, refused in our words.

A file must be a regular file (a FIFO or ``/dev/zero`` never blocks or floods a read); its
safetensors header is bounded and validated before any tensor is read; a file that is not
safetensors is named for what it is; float8 tensors are upcast to float32 (what diffusers' load
into float32 LoRA layers gives); every dtype that is not a float weight is refused by kind
(booleans, complex and packed formats when read, integers as weights), never a 500; JSON nested
too deeply (header, ``adapter_config.json``, ``lora_adapter_metadata``) is a bad file, not a bad
request; PEFT config fields of the wrong kind are refused naming the source and the field, and a
config whose patterns would backtrack for minutes is refused within its time budget. Through the
LoRA manager each is an HTTP 400 naming ``lora_path`` that changes nothing.
"""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from fixtures.lora_formats import SAMPLE, diffusers_sd, random_pairs, zimage_spec
from fixtures.lora_model import assert_params_equal, build_model, make_manager, params, write_lora
from safetensors.torch import save_file
from sglang.multimodal_gen.entrypoints.openai_errors import describe_exception
from sglang.multimodal_gen.errors import LoRAFormatError, LoRAPatternTooExpensiveError
from sglang.multimodal_gen.lora import convert_to_canonical, load_lora_state_dict
from sglang.multimodal_gen.lora.peft_config import MAX_CONFIG_DEPTH, config_from_sources


@pytest.fixture(scope="module")
def sd():
    return diffusers_sd(random_pairs(SAMPLE[:2], seed=300))


def _header_file(path, header, data: bytes = b"") -> str:
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + data)
    return str(path)


def _load_within(path, seconds: float = 10.0):
    """``load_lora_state_dict(path)`` in a thread: a read that blocks fails the test, not hangs."""
    out: dict = {}

    def run():
        try:
            out["value"] = load_lora_state_dict(path)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"loading {path} blocked"
    if "error" in out:
        raise out["error"]
    return out["value"]


# ------------------------------------------------------------------------------ dtypes


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_tensors_are_upcast_to_float32(tmp_path, sd, dtype):
    p = tmp_path / "f8.safetensors"
    f8 = {k: v.to(dtype) for k, v in sd.items()}
    save_file(f8, str(p))
    loaded, md = load_lora_state_dict(p)
    assert loaded.keys() == f8.keys()
    for k in f8:
        assert loaded[k].dtype == torch.float32
        assert torch.equal(loaded[k], f8[k].float()), k  # exact: float8 values are float32 values
    # converts and merges exactly like the float32 file holding the same values
    p32 = tmp_path / "f32.safetensors"
    save_file({k: v.float() for k, v in f8.items()}, str(p32))
    a = convert_to_canonical(loaded, md, zimage_spec())
    b = convert_to_canonical(*load_lora_state_dict(p32), zimage_spec())
    for m, shards in a.modules.items():
        for sid, w in shards.items():
            assert torch.equal(w.delta_weight(), b.modules[m][sid].delta_weight())


def test_f8_e8m0_and_unknown_dtypes_refused(tmp_path):
    p = _header_file(
        tmp_path / "e8.safetensors",
        {"m.lora_A.weight": {"dtype": "F8_E8M0", "shape": [2], "data_offsets": [0, 2]}},
        b"\0\0",
    )
    with pytest.raises(LoRAFormatError) as e:
        load_lora_state_dict(p)
    assert "tensor 'm.lora_A.weight' has dtype F8_E8M0" in e.value.message
    assert e.value.param == "lora_path"
    p = _header_file(
        tmp_path / "x.safetensors",
        {"m": {"dtype": "Q4_K", "shape": [2], "data_offsets": [0, 2]}},
        b"\0\0",
    )
    with pytest.raises(LoRAFormatError, match="unknown dtype 'Q4_K'"):
        load_lora_state_dict(p)


# ------------------------------------------------------------------------------ what it really is


@pytest.mark.parametrize(
    "data,needle",
    [
        (b"", "the file is empty"),
        (
            b"version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 9\n",
            "Git LFS pointer file, not the weights: the download is incomplete",
        ),
        (b"\n<!DOCTYPE html>\n<html>Sign in</html>", "an HTML page"),
        (b"PK\x03\x04" + b"\0" * 60, "a zip archive"),
        (b"\x80\x04\x95" + b"\0" * 60, "a Python pickle"),
        (b"\0" * 64, "its first bytes are not a safetensors header"),
        ((1 << 40).to_bytes(8, "little") + b"{" + b" " * 60, "its header would be"),
    ],
)
def test_not_safetensors_says_what_it_is(tmp_path, data, needle):
    p = tmp_path / "w.safetensors"
    p.write_bytes(data)
    with pytest.raises(LoRAFormatError) as e:
        load_lora_state_dict(p)
    assert needle in e.value.message, e.value.message
    assert "pickle/zip checkpoint renamed" not in e.value.message


class _CountingFile:
    """A file object that counts the bytes read through it."""

    def __init__(self, f, counter: list):
        self._f, self._counter = f, counter

    def read(self, n=-1):
        data = self._f.read(n)
        self._counter.append(len(data))
        return data

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def test_sparse_2gib_file_refused_without_reading_it(tmp_path, monkeypatch):
    import sglang.multimodal_gen.lora.safetensors_io as sio

    p = tmp_path / "huge.safetensors"
    with open(p, "wb") as f:
        f.truncate(2 << 30)  # sparse: no disk used
    counter: list[int] = []
    real_open = sio.open_regular

    def counting_open(path):
        f, size = real_open(path)
        return _CountingFile(f, counter), size

    monkeypatch.setattr(sio, "open_regular", counting_open)
    with pytest.raises(LoRAFormatError, match="not a safetensors file"):
        load_lora_state_dict(p)
    assert sum(counter) <= 64, counter


@pytest.mark.parametrize(
    "header,needle",
    [
        ({"__metadata__": 5}, "its __metadata__ is a number; it must be an object of strings"),
        ({"__metadata__": "abc"}, "its __metadata__ is a string"),
        ({"__metadata__": {"r": 4}}, "__metadata__ entry 'r' is a number"),
        ([1, 2], "not a safetensors file"),
        ({"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}}, "needs 16 bytes"),
        ({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, "invalid shape"),
        ({"t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, "invalid data_offsets"),
        ({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, "truncated"),
    ],
)
def test_bad_headers_refused_in_our_words(tmp_path, header, needle):
    p = _header_file(tmp_path / "h.safetensors", header, b"\0" * 8)
    with pytest.raises(LoRAFormatError) as e:
        load_lora_state_dict(p)
    assert needle in e.value.message, e.value.message
    assert "dictionary update" not in e.value.message


def test_lora_adapter_metadata_must_be_an_object(tmp_path, sd):
    p = tmp_path / "x.safetensors"
    save_file(sd, str(p), metadata={"lora_adapter_metadata": "[1, 2]"})
    with pytest.raises(LoRAFormatError, match="is a list, not a JSON object"):
        load_lora_state_dict(p)


# ------------------------------------------------------------------------------ regular files only


def test_fifo_and_devices_refused_without_blocking(tmp_path, sd):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(LoRAFormatError, match=r"a FIFO \(named pipe\), not a regular file"):
        _load_within(fifo)
    with pytest.raises(LoRAFormatError, match="a character device, not a regular file"):
        _load_within("/dev/zero")
    # a peft folder whose adapter_config.json is a FIFO: not read either
    folder = tmp_path / "peft"
    folder.mkdir()
    save_file(sd, str(folder / "adapter_model.safetensors"))
    os.mkfifo(folder / "adapter_config.json")
    loaded, md = _load_within(folder)
    assert md["adapter_config"] is None  # a FIFO is not a config file


def test_adapter_config_bounded_and_checked(tmp_path, sd):
    folder = tmp_path / "peft"
    folder.mkdir()
    save_file(sd, str(folder / "adapter_model.safetensors"))
    cfg = folder / "adapter_config.json"
    cfg.write_text("")
    with pytest.raises(LoRAFormatError, match="the file is empty"):
        load_lora_state_dict(folder)
    cfg.write_text("[1]")
    with pytest.raises(LoRAFormatError, match="is a list, not a JSON object"):
        load_lora_state_dict(folder)
    cfg.write_text(json.dumps({"r": 4, "pad": "x" * (1 << 20)}))
    with pytest.raises(LoRAFormatError, match="an adapter config is at most"):
        load_lora_state_dict(folder)


# ------------------------------------------------------------------------------ PEFT config fields


@pytest.mark.parametrize(
    "config,needle",
    [
        ({"r": "abc"}, "adapter_config.json: r must be a positive integer, got 'abc'"),
        ({"r": 0}, "r must be a positive integer, got 0"),
        ({"r": True}, "r must be a positive integer, got True"),
        ({"lora_alpha": "x"}, "lora_alpha must be a finite number within float32 range"),
        ({"lora_alpha": 1e300}, "lora_alpha must be a finite number within float32 range"),
        ({"alpha_pattern": {"(": 2}}, "alpha_pattern key '(' is not a valid regular expression"),
        ({"rank_pattern": {"to_q": "abc"}}, "rank_pattern['to_q'] must be a positive integer"),
        ({"alpha_pattern": {"to_q": 1e39}}, "alpha_pattern['to_q'] must be a finite number"),
        ({"alpha_pattern": "to_q"}, "alpha_pattern must be an object"),
        ({"target_modules": "(["}, "target_modules (a regular expression) '([' is not a valid"),
        ({"target_modules": [1, 2]}, "target_modules must be a string or a list of strings"),
    ],
)
def test_peft_fields_of_the_wrong_kind_refused(config, needle):
    with pytest.raises(LoRAFormatError) as e:
        config_from_sources({"adapter_config": config})
    assert needle in e.value.message, e.value.message
    assert "invalid literal" not in e.value.message and "could not convert" not in e.value.message


def test_header_config_fields_checked_too(tmp_path, sd):
    p = tmp_path / "x.safetensors"
    save_file(sd, str(p), metadata={"r": "abc"})
    loaded, md = load_lora_state_dict(p)
    with pytest.raises(LoRAFormatError, match="safetensors metadata: r must be a positive integer"):
        convert_to_canonical(loaded, md, zimage_spec())
    cfg = config_from_sources(
        {"adapter_config": {"r": "4", "lora_alpha": "8", "alpha_pattern": {"to_q": 2}}}
    )
    assert (cfg.r, cfg.lora_alpha, cfg.alpha_pattern) == (4, 8.0, {"to_q": 2.0})


# ------------------------------------------------------------------------------ through the manager


def _refused_by_manager(root, path, nickname="x"):
    """``set_lora`` of ``path`` on a fresh manager: the error, after checking that it is an HTTP
    400 naming ``lora_path`` and that nothing changed (weights, loaded adapters)."""
    model = build_model()
    mgr = make_manager(model, {"root": str(root)})
    before = params(model)
    with pytest.raises(LoRAFormatError) as e:
        mgr.set_lora(nickname, str(path))
    status, body, _ = describe_exception(e.value)
    assert (status, body["error"]["param"]) == (400, "lora_path"), (status, body)
    assert mgr.list_loras()["loaded"] == []
    assert_params_equal(model, before)
    return e.value


# ---- dtypes that are not weights, by kind


@pytest.mark.parametrize(
    "dtype,needle",
    [
        ("BOOL", "booleans, not numbers"),
        ("C64", "complex numbers"),
        ("F8_E8M0", "an exponent-only scale format"),
        ("F4", "a packed 4-bit format"),
        ("F6_E2M3", "a packed 6-bit format"),
        ("F6_E3M2", "a packed 6-bit format"),
    ],
)
def test_dtypes_without_usable_numbers_refused_when_read(tmp_path, dtype, needle):
    p = _header_file(
        tmp_path / "x.safetensors",
        {"m.lora_A.weight": {"dtype": dtype, "shape": [2], "data_offsets": [0, 16]}},
        b"\0" * 16,
    )
    with pytest.raises(LoRAFormatError) as e:
        load_lora_state_dict(p)
    assert f"tensor 'm.lora_A.weight' has dtype {dtype}, {needle}" in e.value.message
    assert e.value.param == "lora_path"


def test_bool_and_complex_files_are_a_400_not_a_500(tmp_path):
    """A real file cast to torch.bool used to crash in the adapter's peak computation (500)."""
    for dtype in (torch.bool, torch.complex64):
        path = tmp_path / f"{str(dtype)[6:]}.safetensors"
        write_lora(path, 1)
        save_file({k: v.to(dtype) for k, v in load_lora_state_dict(path)[0].items()}, str(path))
        err = _refused_by_manager(tmp_path, path)
        assert "not numbers" in err.message or "complex numbers" in err.message, err.message


INT_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
INT_DTYPES += [torch.uint16, torch.uint32, torch.uint64]


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=lambda d: str(d)[6:])
def test_integer_weights_refused_naming_the_module(tmp_path, dtype):
    path = tmp_path / "i.safetensors"
    write_lora(path, 2)
    save_file({k: v.to(dtype) for k, v in load_lora_state_dict(path)[0].items()}, str(path))
    err = _refused_by_manager(tmp_path, path)
    name = str(dtype).removeprefix("torch.")
    assert f"has dtype {name}; LoRA weights must be floating point" in err.message, err.message


def test_non_float_tensors_refused_in_every_role(sd):
    """Converting an in-memory state dict (the Python API) checks the same: lora_B.bias, diff_b,
    LoKr factors; an alpha must be a real number (an integer alpha is fine)."""
    spec = zimage_spec()
    a_key = next(k for k in sd if k.endswith("lora_A.weight"))
    module = a_key[: -len(".lora_A.weight")]
    out = sd[a_key.replace("lora_A", "lora_B")].shape[0]
    cases = {
        "lora_B.bias": {f"{module}.lora_B.bias": torch.zeros(out, dtype=torch.int32)},
        "diff_b": {f"{module}.diff_b": torch.zeros(out, dtype=torch.bool)},
        "alpha": {f"{module}.alpha": torch.tensor(True)},
    }
    for what, extra in cases.items():
        with pytest.raises(LoRAFormatError, match=f"{what} has dtype"):
            convert_to_canonical({**sd, **extra}, None, spec)
    lokr = {
        "transformer.layers.0.attention.to_q.lokr_w1": torch.ones(2, 2, dtype=torch.int64),
        "transformer.layers.0.attention.to_q.lokr_w2": torch.ones(32, 32),
    }
    with pytest.raises(LoRAFormatError, match="lokr_w1 has dtype int64"):
        convert_to_canonical(lokr, None, spec)
    # an integer alpha (extraction scripts store the rank as torch.tensor(r)): alpha / r applies
    r = sd[a_key].shape[0]
    c = convert_to_canonical({**sd, f"{module}.alpha": torch.tensor(2 * r)}, None, spec)
    assert any(w.scale == 2.0 for shards in c.modules.values() for w in shards.values())


# ---- JSON nested too deeply


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


@pytest.mark.parametrize("levels", [990, 200_000])
def test_deep_json_in_a_file_is_a_bad_file(tmp_path, sd, levels):
    """200000 levels: json.loads itself gives up (RecursionError). 990 levels: it parses, and
    comparing or hashing it later would. Both are the file's fault, named as such."""
    deep = _deep(levels)
    # the safetensors header itself
    raw = b'{"__metadata__": ' + deep.encode() + b"}"
    p = tmp_path / "h.safetensors"
    p.write_bytes(len(raw).to_bytes(8, "little") + raw)
    with pytest.raises(LoRAFormatError) as e:
        load_lora_state_dict(p)
    assert e.value.param == "lora_path"
    assert "nested too deeply" in e.value.message or "__metadata__ is a list" in e.value.message
    # adapter_config.json of a peft folder
    folder = tmp_path / "peft"
    folder.mkdir()
    save_file(sd, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text('{"r": 4, "layers_to_transform": ' + deep + "}")
    with pytest.raises(LoRAFormatError, match="nested") as e:
        load_lora_state_dict(folder)
    assert e.value.param == "lora_path"
    # diffusers' lora_adapter_metadata, and a plain header entry
    for key in ("lora_adapter_metadata", "layers_to_transform"):
        value = '{"r": 4, "x": ' + deep + "}" if key == "lora_adapter_metadata" else deep
        p = tmp_path / f"{key}.safetensors"
        save_file(sd, str(p), metadata={key: value})
        with pytest.raises(LoRAFormatError, match="nested") as e:
            convert_to_canonical(*load_lora_state_dict(p), zimage_spec())
        assert e.value.param == "lora_path"


def test_deep_header_through_the_manager(tmp_path):
    raw = b'{"__metadata__": ' + _deep(200_000).encode() + b"}"
    p = tmp_path / "deep.safetensors"
    p.write_bytes(len(raw).to_bytes(8, "little") + raw)
    err = _refused_by_manager(tmp_path, p)
    assert "its header is JSON nested too deeply" in err.message, err.message


def test_config_depth_bound_allows_real_configs():
    nested = {"a": {"b": [[1, {"c": [2]}]]}}  # 6 levels
    cfg = config_from_sources({"adapter_config": {"r": 4, "eva_config": nested}})
    assert cfg.r == 4
    too_deep = json.loads(_deep(MAX_CONFIG_DEPTH + 1))
    with pytest.raises(LoRAFormatError, match=f"nested more than {MAX_CONFIG_DEPTH} levels"):
        config_from_sources({"adapter_config": {"r": 4, "layers_to_transform": too_deep}})


# ---- config patterns


def test_catastrophic_config_pattern_is_a_400_within_the_budget(tmp_path, monkeypatch):
    """A peft folder whose adapter_config.json holds a pattern that backtracks exponentially: the
    load is refused within the config's time budget (re would run it to the end: seconds per
    module name, minutes for '(.*)*X'-like patterns on longer names), naming the field."""
    import time

    from sglang.multimodal_gen.lora import patterns

    monkeypatch.setattr(patterns, "PATTERN_BUDGET_S", 0.05)
    folder = tmp_path / "redos"
    folder.mkdir()
    write_lora(folder / "adapter_model.safetensors", 3)
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 4, "target_modules": r"(.|.)*[XY]"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    err = _refused_by_manager(tmp_path, folder)
    assert time.perf_counter() - start < 5.0  # the budget (0.05 s) and building a tiny model
    assert isinstance(err, LoRAPatternTooExpensiveError)
    assert "adapter_config.json: target_modules '(.|.)*[XY]' is too expensive to match" in (
        err.message
    )
