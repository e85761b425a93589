"""A config's patterns (``lora/patterns.py``): ``target_modules`` / ``exclude_modules`` and
pattern keys matched with re's (peft's) meaning by the regex package under one time budget per
config; a pattern too expensive to match or to compile is refused naming the field.

Reference: re itself and peft's own matching functions."""

from __future__ import annotations

import pytest
from fixtures.lora_formats import diffusers_sd, random_pairs, zimage_spec
from peft import LoraConfig
from sglang.multimodal_gen.errors import LoRAFormatError
from sglang.multimodal_gen.lora import config_from_sources, convert_to_canonical, get_pattern_key


@pytest.fixture(scope="module")
def spec():
    return zimage_spec()


#: module names (those of ``test_peft_config.py``'s ``get_pattern_key`` test)
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
