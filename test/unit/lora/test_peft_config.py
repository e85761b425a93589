"""PEFT semantics: adapters written by peft (and diffusers) load with peft's own per-module scale.

Reference: peft 0.21 itself. Each test wraps a fresh tiny diffusers Z-Image model with
``get_peft_model`` (or diffusers' ``add_adapter``), randomizes every ``lora_B`` (peft initializes it
to zero), saves the adapter the way peft / diffusers do, loads the folder with our loader and
compares each module's delta to peft's ``LoraLayer.get_delta_weight``. How a config's patterns
match module names: ``test_patterns.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.lora_formats import diffusers_sd, our_slot, random_pairs, save, zimage_spec
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from peft.utils.other import get_pattern_key as peft_get_pattern_key
from safetensors.torch import save_file
from sglang.multimodal_gen.errors import LoRAFormatError
from sglang.multimodal_gen.lora import (
    config_from_sources,
    convert_to_canonical,
    get_pattern_key,
    load_lora_state_dict,
)

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"]
# (all_final_layer's adaLN_modulation.0 is a SiLU, so the linear ones are named in full)
TARGETS += [
    "layers.0.adaLN_modulation.0",
    "layers.1.adaLN_modulation.0",
    "noise_refiner.0.adaLN_modulation.0",
]


@pytest.fixture(scope="module")
def spec():
    return zimage_spec()


def _fresh_model():
    from diffusers import ZImageTransformer2DModel
    from fixtures.lora_formats import DIM

    return ZImageTransformer2DModel(
        in_channels=4,
        dim=DIM,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=4,
        n_kv_heads=4,
        cap_feat_dim=32,
        axes_dims=[4, 6, 6],
        axes_lens=[32, 32, 32],
    )


def _randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _peft_deltas(model, strip: str):
    """``{diffusers module name: (delta, r, scaling)}`` from peft's own layers."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, LoraLayer) and "default" in mod.lora_A:
            n = name[len(strip) :] if name.startswith(strip) else name
            out[n] = (
                mod.get_delta_weight("default").double(),
                mod.r["default"],
                mod.scaling["default"],
            )
    return out


def _assert_matches_peft(canon, peft_deltas):
    assert canon.matched_modules == len(peft_deltas)
    for n, (delta, r, scaling) in peft_deltas.items():
        our, sid = our_slot(n)  # hand-written table, not the name map under test
        w = canon.modules[our][sid]
        assert w.rank == r, n
        assert w.scale == pytest.approx(scaling), n
        assert delta.abs().max() > 0
        torch.testing.assert_close(w.delta_weight().double(), delta, atol=1e-6, rtol=1e-5, msg=n)


CONFIGS = {
    "plain": dict(r=4, lora_alpha=8),
    "rslora": dict(r=4, lora_alpha=6, use_rslora=True),
    "patterns": dict(
        r=4,
        lora_alpha=8,
        # first matching key wins: every w2 gets 5 (not 2); rank and alpha resolved independently
        rank_pattern={"feed_forward.w2": 5, "w2": 2, "layers.1.attention.to_k": 6, "to_v": 3},
        alpha_pattern={
            "to_q": 16,
            "layers.1.attention.to_q": 2,
            "adaLN_modulation.0": 1,
            "to_v": 7,
        },
    ),
    "patterns_rslora": dict(
        r=8,
        lora_alpha=4,
        use_rslora=True,
        rank_pattern={r"layers\.\d\.attention\.to_[qk]": 2},
        alpha_pattern={r".*_refiner\.0\..*": 32},
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_peft_save_pretrained_folder(tmp_path, spec, name):
    model = get_peft_model(_fresh_model(), LoraConfig(target_modules=TARGETS, **CONFIGS[name]))
    _randomize(model, seed=len(name))
    model.save_pretrained(str(tmp_path))
    assert (tmp_path / "adapter_config.json").exists()
    sd, md = load_lora_state_dict(tmp_path)
    assert md["kind"] == "peft" and md["adapter_config"]["r"] == CONFIGS[name]["r"]
    canon = convert_to_canonical(sd, md, spec)
    assert canon.source_format == "peft"
    # reference: peft loading the folder. peft writes adapter_config.json with sorted keys, so
    # overlapping patterns resolve in sorted order on reload (for "patterns" layers.1's to_q gets
    # alpha 2 from the file, 16 in the model that wrote it); we follow the file, as peft does.
    reloaded = PeftModel.from_pretrained(_fresh_model(), str(tmp_path))
    _assert_matches_peft(canon, _peft_deltas(reloaded, "base_model.model."))
    if name != "patterns":
        _assert_matches_peft(canon, _peft_deltas(model, "base_model.model."))


def test_peft_state_dict_and_config_save_pretrained(tmp_path, spec):
    """The two-step form: get_peft_model_state_dict + LoraConfig.save_pretrained."""
    cfg = LoraConfig(
        target_modules=["to_q", "w1", "all_x_embedder.2-1"],
        r=4,
        lora_alpha=8,
        rank_pattern={"w1": 6, r"layers\.0\.attention\.to_q": 2},
        alpha_pattern={"all_x_embedder.2-1": 3, "to_q": 5},
    )
    model = get_peft_model(_fresh_model(), cfg)
    _randomize(model, seed=21)
    save_file(get_peft_model_state_dict(model), str(tmp_path / "adapter_model.safetensors"))
    cfg.save_pretrained(str(tmp_path))
    canon = convert_to_canonical(*load_lora_state_dict(tmp_path), spec)
    reloaded = PeftModel.from_pretrained(_fresh_model(), str(tmp_path))
    _assert_matches_peft(canon, _peft_deltas(reloaded, "base_model.model."))


def test_diffusers_save_lora_adapter_metadata(tmp_path, spec):
    """diffusers' model-level save writes the config bare in `lora_adapter_metadata`."""
    model = _fresh_model()
    model.add_adapter(LoraConfig(target_modules=TARGETS, **CONFIGS["patterns"]))
    _randomize(model, seed=22)
    model.save_lora_adapter(str(tmp_path))
    sd, md = load_lora_state_dict(tmp_path)
    assert md["kind"] == "diffusers" and md["lora_adapter_metadata"]["lora_alpha"] == 8
    canon = convert_to_canonical(sd, md, spec)
    # reference: diffusers loading the same folder into a fresh model (config from the metadata)
    reloaded = _fresh_model()
    reloaded.load_lora_adapter(
        str(tmp_path), prefix=None, adapter_name="default", use_safetensors=True
    )
    _assert_matches_peft(canon, _peft_deltas(reloaded, ""))


def test_diffusers_pipeline_save_lora_weights_prefixed_metadata(tmp_path, spec):
    """A pipeline's save_lora_weights prefixes the config fields with `transformer.`."""
    from diffusers import ZImagePipeline

    cfg = LoraConfig(target_modules=TARGETS, **CONFIGS["rslora"])
    model = _fresh_model()
    model.add_adapter(cfg)
    _randomize(model, seed=23)
    ZImagePipeline.save_lora_weights(
        str(tmp_path),
        transformer_lora_layers=get_peft_model_state_dict(model),
        transformer_lora_adapter_metadata=cfg.to_dict(),
    )
    sd, md = load_lora_state_dict(tmp_path)
    assert "transformer.lora_alpha" in md["lora_adapter_metadata"]
    canon = convert_to_canonical(sd, md, spec)
    assert canon.source_format == "diffusers"
    _assert_matches_peft(canon, _peft_deltas(model, ""))


NAMES = [
    "layers.0.attention.to_q",
    "layers.1.attention.to_q",
    "layers.10.attention.to_q",
    "noise_refiner.0.feed_forward.w2",
    "context_refiner.0.attention.to_out.0",
    "layers.0.adaLN_modulation.0",
    "all_x_embedder.2-1",
    "xto_q",
]
PATTERNS = [
    {"to_q": 1, "layers.1.attention.to_q": 2},
    {"layers.1.attention.to_q": 2, "to_q": 1},
    {r"layers\.1\d?\.attention\.to_q": 3, "w2": 4},
    {"attention.to_out.0": 5, "2-1": 6, r".*refiner.*": 7},
    {"q": 8, "0": 9},
    {},
]


@pytest.mark.parametrize("patterns", PATTERNS)
def test_get_pattern_key_matches_peft(patterns):
    for n in NAMES:
        ours = get_pattern_key(patterns, n)
        theirs = peft_get_pattern_key(patterns.keys(), n)
        # peft returns the name itself when nothing matches; we return None
        assert (ours if ours is not None else n) == theirs, (patterns, n)


def test_alpha_precedence(spec):
    pairs = random_pairs(["layers.0.attention.to_q", "layers.0.attention.to_k"], seed=24)
    sd = diffusers_sd(pairs)
    q = ("layers.0.attention.to_qkv", "q")
    k = ("layers.0.attention.to_qkv", "k")

    def scales(sd, md):
        c = convert_to_canonical(sd, md, spec)
        return c.modules[q[0]][q[1]].scale, c.modules[k[0]][k[1]].scale

    # nothing: alpha = r
    assert scales(sd, None) == (1.0, 1.0)
    # config (with pattern)
    cfg = {"adapter_config": {"r": 4, "lora_alpha": 2, "alpha_pattern": {"to_k": 12}}}
    assert scales(sd, cfg) == (0.5, 3.0)
    # a module's own .alpha tensor wins over the config
    sd2 = dict(sd, **{"transformer.layers.0.attention.to_q.alpha": torch.tensor(8.0)})
    assert scales(sd2, cfg) == (2.0, 3.0)


def test_conflicting_sources_raise(tmp_path, spec):
    sd = diffusers_sd(random_pairs(["layers.0.attention.to_q"], seed=25))
    save_file(
        sd,
        str(tmp_path / "adapter_model.safetensors"),
        metadata={"lora_adapter_metadata": json.dumps({"r": 4, "lora_alpha": 16})},
    )
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    loaded, md = load_lora_state_dict(tmp_path)
    with pytest.raises(LoRAFormatError, match="conflicting.*lora_alpha"):
        convert_to_canonical(loaded, md, spec)
    # agreeing sources are fine
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 16}))
    c = convert_to_canonical(*load_lora_state_dict(tmp_path), spec)
    assert c.modules["layers.0.attention.to_qkv"]["q"].scale == 4.0


@pytest.mark.parametrize(
    "field,value,feature",
    [
        ("use_dora", True, "DoRA"),
        ("modules_to_save", ["proj_out"], "modules_to_save"),
        ("fan_in_fan_out", True, "fan_in_fan_out"),
        ("peft_type", "LOHA", "LOHA"),
        ("peft_type", "LOKR", "LOKR"),
    ],
)
def test_unsupported_config_features_refused(spec, field, value, feature):
    sd = diffusers_sd(random_pairs(["layers.0.attention.to_q"], seed=26))
    with pytest.raises(LoRAFormatError, match=feature):
        convert_to_canonical(sd, {"adapter_config": {"r": 4, field: value}}, spec)


def test_config_rank_and_target_disagreeing_with_tensors_raise(spec):
    sd = diffusers_sd(
        random_pairs(["layers.0.attention.to_q", "layers.0.feed_forward.w2"], seed=27)
    )
    with pytest.raises(LoRAFormatError, match="r=8.*rank 4"):
        convert_to_canonical(sd, {"adapter_config": {"r": 8, "lora_alpha": 8}}, spec)
    with pytest.raises(LoRAFormatError, match="target_modules"):
        convert_to_canonical(sd, {"adapter_config": {"r": 4, "target_modules": ["to_q"]}}, spec)
    c = convert_to_canonical(
        sd, {"adapter_config": {"r": 4, "target_modules": ["to_q", "w2"]}}, spec
    )
    assert c.matched_modules == 2
    c = convert_to_canonical(sd, {"adapter_config": {"r": 4, "target_modules": "all-linear"}}, spec)
    assert c.matched_modules == 2


def test_config_from_raw_safetensors_header(tmp_path, spec):
    """Plain header entries (strings) are a config source too."""
    sd = diffusers_sd(random_pairs(["layers.0.attention.to_q"], seed=28))
    path = save(tmp_path, "h.safetensors", sd, metadata={"lora_alpha": "2", "use_rslora": "true"})
    loaded, md = load_lora_state_dict(path)
    cfg = config_from_sources(md)
    assert cfg.lora_alpha == 2.0 and cfg.use_rslora
    c = convert_to_canonical(loaded, md, spec)
    assert c.modules["layers.0.attention.to_qkv"]["q"].scale == pytest.approx(1.0)  # 2 / sqrt(4)


@pytest.mark.filterwarnings("ignore:.*invalid shape")  # peft mistakes the 1-D bias for a shard
@pytest.mark.filterwarnings("ignore:.*lora_bias=True. was passed")
def test_peft_lora_bias_becomes_scaled_offset(tmp_path, spec):
    """lora_bias=True: peft adds scale * (B A x + b_B); our offset is b_B, scaled like the delta."""
    model = get_peft_model(
        _fresh_model(), LoraConfig(target_modules=["to_k", "w2"], r=4, lora_alpha=6, lora_bias=True)
    )
    _randomize(model, seed=29)
    model.save_pretrained(str(tmp_path))
    canon = convert_to_canonical(*load_lora_state_dict(tmp_path), spec)
    x = torch.randn(3, 64)
    for name, mod in model.named_modules():
        if not isinstance(mod, LoraLayer) or not name.endswith("layers.0.attention.to_k"):
            continue
        with torch.no_grad():
            peft_delta = mod(x) - mod.get_base_layer()(x)
        w = canon.modules["layers.0.attention.to_qkv"]["k"]
        ours = w.scale * ((x @ w.lora_A.t()) @ w.lora_B.t() + w.offset)
        assert w.offset is not None and w.offset.abs().max() > 0
        torch.testing.assert_close(ours, peft_delta, atol=1e-6, rtol=1e-5)
        break
    else:
        raise AssertionError("peft did not wrap to_k")
