"""PEFT semantics: adapters written by peft (and diffusers) load with peft's own per-module scale.

Reference: peft 0.21 itself. Each test wraps a fresh tiny diffusers Z-Image model with
``get_peft_model`` (or diffusers' ``add_adapter``), randomizes every ``lora_B`` (peft initializes it
to zero), saves the adapter the way peft / diffusers do, loads the folder with our loader and
compares each module's delta to peft's ``LoraLayer.get_delta_weight``.
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


# ------------------------------------------------------------------------------ config patterns
# A config's regular expressions are matched by the regex package with a time bound, with re's
# (peft's) meaning. Reference: re itself and peft's own matching functions.

PATTERN_NAMES = NAMES + [
    "a",
    "ab",
    "K",
    "k",
    "s",
    "I",
    "i",
    "\x1c",
    "a\n",
    "",
    ".",
    "a.b",
    "layers.0.attention.to_k",
    "x{e<=1}",
]
# constructs the two engines read differently, and peft's usual forms
TRICKY_PATTERNS = [
    r"to_q",
    r".*\.to_(q|k)",
    r"layers\.\d+\.attention\.to_[qkv]",
    r".*(to_out\.0|w2)$",
    r"(?:a){e<=1}",  # fuzzy matching to regex, literal braces to re
    r"x{e<=1}",
    r"[[:alpha:]]+",  # a POSIX class to regex, a set holding '[' ':' ... to re
    r"[\s]",  # re's \s holds \x1c-\x1f, regex's not
    r"[\S.]+",
    r"(?i)ı",  # re: matches 'i' (and 'I'); regex: not
    r"(?i)[ı-ſ]",
    r"(?i)İ",
    r"\B",  # re: no match in an empty string (before Python 3.14)
    r"(a)\1?b?",
    r"(?P<x>a)(?P=x)?",
    r"(?=a)a",
    r"(?<=a)b|a",
    r"(a)?(?(1)b|k)",
    r"a{,2}",
    r"(?>a|ab)b?",
    r"a++",
    r"(?x) a b # comment",
    r"(?s).",
    r"(?a)\w",
    r".",
    r"-",
]


def _matches_re(pattern: str, name: str, key: bool) -> bool:
    import re

    if key:
        return re.match(rf"(.*\.)?({pattern})$", name) is not None
    return re.fullmatch(pattern, name) is not None


@pytest.mark.filterwarnings("ignore:Possible nested set:FutureWarning")
@pytest.mark.parametrize("pattern", TRICKY_PATTERNS)
def test_config_patterns_keep_re_meaning(pattern):
    """target_modules / exclude_modules (re.fullmatch) and pattern keys (peft's get_pattern_key)
    give re's answer for every name, whatever regex would read in the pattern."""
    import re

    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils.other import get_pattern_key as peft_key

    targeted = config_from_sources({"adapter_config": {"target_modules": pattern}})
    excluded = config_from_sources({"adapter_config": {"exclude_modules": pattern}})
    try:  # as a key it is wrapped in (.*\.)?(KEY)$, where global flags are an error
        re.compile(rf"(.*\.)?({pattern})$")
        as_key = True
    except re.error:
        as_key = False
        with pytest.raises(LoRAFormatError, match="is not a valid regular expression"):
            config_from_sources({"adapter_config": {"rank_pattern": {pattern: 2}}})
    for name in PATTERN_NAMES:
        want = _matches_re(pattern, name, key=False)
        assert targeted.targets(name) is want, (pattern, name)
        assert excluded.targets(name) is not want, (pattern, name)
        if name:  # peft's own function (a module name is never empty there)
            peft_cfg = LoraConfig(target_modules=pattern)
            assert bool(check_target_module_exists(peft_cfg, name)) is want, (pattern, name)
        if not as_key:
            continue
        want_key = _matches_re(pattern, name, key=True)
        assert (get_pattern_key([pattern], name) is not None) is want_key, (pattern, name)
        assert (peft_key([pattern], name) == pattern) is (want_key or pattern == name)


@pytest.mark.filterwarnings("ignore:Possible nested set:FutureWarning")
def test_config_patterns_keep_re_meaning_randomized():
    """Random patterns built from the constructs above (groups, repeats, lookarounds, flags):
    every match equals re's, as a target_modules pattern and as a pattern key."""
    import random
    import re

    rng = random.Random(0)
    atoms = [
        "a", "k", "K", "s", "i", "ı", "İ", "ſ", ".", r"\.", r"\d", r"\w", r"\s", r"\S", r"\W",
        "[a-c]", "[^a]", r"[\s.]", r"[\S_]", "[[:alpha:]]", "x{e<=1}", "{", "a{,2}", r"\b",
        r"\B", "^", "$", r"\A", r"\Z", "-", "0", r"\x1c", "(?i:a)", "(?s:.)", "(?a:\\w)",
    ]  # fmt: skip

    def gen(depth=0):
        r = rng.random()
        if depth > 3 or r < 0.35:
            return rng.choice(atoms)
        if r < 0.5:
            return gen(depth + 1) + gen(depth + 1)
        if r < 0.6:
            return "(" + gen(depth + 1) + ")"
        if r < 0.7:
            return "(?:" + gen(depth + 1) + "|" + gen(depth + 1) + ")"
        if r < 0.85:
            return "(?:" + gen(depth + 1) + ")" + rng.choice(["*", "+?", "{1,3}", "*+", "?"])
        return rng.choice(["(?=", "(?!", "(?>"]) + gen(depth + 1) + ")"

    names = ["layers.0.attention.to_q", "a", "k", "K", "i", "", ".", "a\n", "\x1c"]
    names += ["".join(rng.choice("akKsiI._-0 \x1c\n") for _ in range(rng.randrange(1, 6)))]
    names += ["".join(rng.choice("akKsiI._-0 \x1c\n") for _ in range(rng.randrange(1, 6)))]
    checked = 0
    for _ in range(400):
        pattern = rng.choice(["", "", "", "(?i)", "(?a)", "(?s)", "(?m)"]) + gen()
        for key in (False, True):
            try:
                re.compile(rf"(.*\.)?({pattern})$" if key else pattern)
            except re.error:
                continue
            cfg = config_from_sources({"adapter_config": {"target_modules": pattern}})
            for name in names:
                want = _matches_re(pattern, name, key)
                got = get_pattern_key([pattern], name) is not None if key else cfg.targets(name)
                assert got is want, (pattern, key, name)
                checked += 1
    assert checked > 4000


def test_name_keys_match_without_regex_as_re_does():
    """Keys made of name characters, escaped dots or dashes (``re.escape`` of a module name) and
    bare dots (the usual cases) take a fast path; same answers as re."""
    import re

    from sglang.multimodal_gen.lora.patterns import _name_key, _name_key_matches

    keys = ["to_q", "attention.to_q", "layers.1.attention.to_q", "0", "2-1", "q", "..", "a.c"]
    keys += [re.escape("layers.1.attention.to_q"), re.escape("all_x_embedder.2-1"), r"a\.c"]
    keys += [r"layers\.1.attention"]
    names = NAMES + ["abc", "a.b.c", "axc", "x.to_q", "to_q.", ".to_q", "layers.1xattention.to_q"]
    for k in keys:
        literal = _name_key(k)
        assert literal is not None, k
        for n in names:
            assert _name_key_matches(literal, n) is _matches_re(k, n, key=True), (k, n)
    for k in [r"a\d", "a+", "(a)", "a|b", r"a\\.b", "[a]", r"\w"]:
        assert _name_key(k) is None, k


# A pattern that backtracks exponentially in both engines (regex needs ~1 s on a 23-character
# name here, and 4x per two more characters).
SLOW = r"(.|.)*[XY]"


@pytest.fixture
def small_budget(monkeypatch):
    from sglang.multimodal_gen.lora import patterns

    monkeypatch.setattr(patterns, "PATTERN_BUDGET_S", 0.05)
    return 0.05


@pytest.mark.parametrize(
    "config,field",
    [
        ({"target_modules": SLOW}, "target_modules"),
        ({"exclude_modules": SLOW}, "exclude_modules"),
        ({"rank_pattern": {SLOW: 4}}, "rank_pattern key"),
        ({"alpha_pattern": {"to_k": 2, SLOW: 4}}, "alpha_pattern key"),
    ],
)
def test_catastrophic_pattern_refused_within_budget(spec, small_budget, config, field):
    """Every config field holding a pattern: the match stops at the config's time budget and the
    file is refused, naming the source, the field and the pattern (HTTP 400, lora_path)."""
    import time

    from sglang.multimodal_gen.entrypoints.openai_errors import describe_exception
    from sglang.multimodal_gen.errors import LoRAPatternTooExpensiveError

    sd = diffusers_sd(random_pairs(["layers.0.attention.to_q", "layers.0.feed_forward.w2"], 30))
    md = {"adapter_config": {"r": 4, "lora_alpha": 4, **config}}
    start = time.perf_counter()
    with pytest.raises(LoRAPatternTooExpensiveError) as e:
        convert_to_canonical(sd, md, spec)
    # the budget counts CPU time; each call may take WALL_PER_CPU times that on a busy machine
    assert time.perf_counter() - start < 4 * small_budget + 2.0
    msg = e.value.message
    assert f"adapter_config.json: {field} '(.|.)*[XY]' is too expensive to match" in msg, msg
    status, body, _ = describe_exception(e.value)
    assert status == 400 and body["error"]["param"] == "lora_path"


def test_one_budget_for_all_matches_of_a_config(small_budget):
    """Each match is far below the budget; together they exceed it: one budget per config (and
    per file: conversions of a file for several targets are given the same one)."""
    from sglang.multimodal_gen.errors import LoRAPatternTooExpensiveError
    from sglang.multimodal_gen.lora.peft_config import PatternBudget

    cfg = config_from_sources({"adapter_config": {"target_modules": SLOW}})
    names = [f"layers.{i:07d}" for i in range(5000)]  # 14 characters: ~2 ms each here
    done = 0
    with pytest.raises(LoRAPatternTooExpensiveError, match="target_modules"):
        for name in names:
            assert not cfg.targets(name)
            done += 1
    assert 3 <= done < len(names) and cfg.budget.left <= 0
    # a spent budget passed to another conversion of the same file: refused at once
    spent = PatternBudget()
    spent.left = 0.0
    sd = diffusers_sd(random_pairs(["layers.0.attention.to_q"], 31))
    md = {"adapter_config": {"r": 4, "target_modules": r".*to_q"}}
    with pytest.raises(LoRAPatternTooExpensiveError, match="target_modules"):
        convert_to_canonical(sd, md, zimage_spec(), pattern_budget=spent)


def test_slow_match_leaves_other_threads_running(monkeypatch):
    """The regex runs with the GIL released: the server's event loop keeps answering."""
    import threading
    import time

    from sglang.multimodal_gen.errors import LoRAPatternTooExpensiveError
    from sglang.multimodal_gen.lora import patterns

    monkeypatch.setattr(patterns, "PATTERN_BUDGET_S", 0.5)
    cfg = config_from_sources({"adapter_config": {"target_modules": SLOW}})
    ticks, stop = [0], threading.Event()

    def ticker():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.002)

    thread = threading.Thread(target=ticker, daemon=True)
    thread.start()
    try:
        with pytest.raises(LoRAPatternTooExpensiveError):
            cfg.targets("layers.0.attention.to_q.abc")  # 27 characters: ~17 s here
    finally:
        stop.set()
        thread.join()
    assert ticks[0] >= 25, ticks  # ~250 at 2 ms; one while the GIL is held


@pytest.mark.parametrize(
    "config,needle",
    [
        # regex compiles repeats by unrolling them: 10^8 elements, gigabytes
        ({"target_modules": "(?:(?:(?:a{100}){100}){100}){100}"}, "too expensive to match"),
        ({"rank_pattern": {"(?:x{65535}){65535}": 2}}, "too expensive to match"),
        # repeated empty groups: regex allocates gigabytes, then crashes the process
        ({"exclude_modules": "(?:(?:(?:(){100}){100}){100}){100}"}, "too expensive to match"),
        ({"target_modules": "a" * 10_001}, "is 10001 characters long; patterns are at most"),
    ],
)
def test_oversized_patterns_refused_before_compiling(spec, config, needle):
    sd = diffusers_sd(random_pairs(["layers.0.attention.to_q"], 32))
    with pytest.raises(LoRAFormatError) as e:
        convert_to_canonical(sd, {"adapter_config": {"r": 4, **config}}, spec)
    assert needle in e.value.message, e.value.message


def test_anchored_name_keys_match_as_re_without_an_engine():
    """peft's docs show per-module keys as '^name' (and configs write 'name$'): the same result
    as re, without spending the config's budget (210 such keys x 840 modules once exceeded it)."""
    import re as re_mod

    from sglang.multimodal_gen.lora.patterns import PatternBudget, PatternMatcher

    names = [
        "layers.0.attention.to_q",
        "layers.10.attention.to_q",
        "xlayers.0.attention.to_q",
        "layers.0.attention.to_q.lora",
        "a.layers.0.attention.to_q",
        "layers.0.attention",
    ]
    keys = ["^layers.0.attention.to_q", "^layers.0.attention.to_q$", "attention.to_q$",
            "^layers\\.0\\.attention\\.to_q", "^layers.0", "layers.0.attention.to_q\\$"]  # fmt: skip
    budget = PatternBudget(seconds=1.0)
    matcher = PatternMatcher(budget)
    for key in keys[:5]:
        for name in names:
            want = re_mod.match(rf"(.*\.)?({key})$", name) is not None
            assert matcher.key_matches(key, name, "rank_pattern key") == want, (key, name)
    assert budget.left == 1.0  # no engine ran
    for name in names:  # an escaped '$' is a literal: the engine path, same result as re
        want = re_mod.match(rf"(.*\.)?({keys[5]})$", name) is not None
        assert matcher.key_matches(keys[5], name, "rank_pattern key") == want
