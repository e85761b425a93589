"""Regular expressions from adapter configs, matched with a time bound and ``re``'s meaning.

The patterns come from the file, so matching them is bounded (:class:`PatternBudget`). Python's
``re`` cannot be interrupted and holds the GIL, so a pattern such as ``(.*)*X`` would freeze the
whole process for minutes. The patterns are therefore run by the ``regex`` package with a
``timeout`` and with the GIL released (``concurrent=True``), under one time budget per adapter
config (:data:`PATTERN_BUDGET_S`; checking, compiling and matching included); a config that needs
more is refused with :class:`~sglang.multimodal_gen.errors.LoRAPatternTooExpensiveError` naming
the field. The meaning stays ``re``'s (peft's): each pattern is parsed by ``re``'s own parser and
written out again for ``regex`` construct by construct, so syntax the two engines read differently
(``{e<=1}`` is fuzzy matching to ``regex``, ``[[:alpha:]]`` a POSIX class; both are literals to
``re``) keeps ``re``'s meaning, and a character class whose ASCII members differ (``\\s`` and the
characters 0x1c-0x1f; case-insensitive ``İ``/``ı`` against ``i``) takes its ASCII members from
``re`` itself. Module names are ASCII, so every match equals ``re``'s (for other characters,
``regex``'s Unicode classes decide). Keys made only of name characters
(``layers.0.attention.to_q``, the usual case) are matched without a regular-expression engine, with
the same result.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

import regex

from sglang.multimodal_gen.errors import LoRAFormatError, LoRAPatternTooExpensiveError

try:  # re's own parser: the patterns keep re's meaning when regex runs them
    from re import _constants as _sre_c
    from re import _parser as _sre_parse
except ImportError:  # Python 3.10
    import sre_constants as _sre_c  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

__all__ = [
    "MAX_PATTERN_CHARS",
    "MAX_PATTERN_UNITS",
    "PATTERN_BUDGET_S",
    "PatternBudget",
    "PatternMatcher",
    "short_pattern",
]


#: Seconds one adapter config's patterns may take in all (checking, compiling and matching them
#: against every module of the file); a config that needs more is refused.
PATTERN_BUDGET_S = 1.0
#: Longest pattern (characters) accepted in ``target_modules``, ``exclude_modules`` or a key of
#: ``rank_pattern`` / ``alpha_pattern``; real configs use tens to hundreds.
MAX_PATTERN_CHARS = 10_000
#: Bound on a pattern's size (its parse-tree nodes) once its counted repeats are written out
#: (``(?:a{1000}){1000}`` is a million): ``regex`` compiles repeats by unrolling them, which takes
#: gigabytes (or crashes, for repeated empty groups) where ``re`` needs nothing; 20000 nodes compile
#: in about 0.1 s.
MAX_PATTERN_UNITS = 20_000

# A pattern key made only of name characters, escaped dots and dashes (``re.escape`` of a module
# name) and bare dots (any character, as in re) is a module name: matched without an engine.
_NAME_KEY = re.compile(r"(?:[A-Za-z0-9_\-.]|\\[.\-])+")
_NAME_KEY_TOKEN = re.compile(r"\\[.\-]|.")

_T = TypeVar("_T")
#: Wall-clock seconds a regex call may take per CPU second left in the budget (other threads
#: and processes share the cores).
WALL_PER_CPU = 4.0


class PatternBudget:
    """The time left for one adapter config's regular expressions (:data:`PATTERN_BUDGET_S`).

    Shared by every check, compile and match of the config's patterns, also across the targets
    a file is converted for. It counts this thread's CPU time, so a busy server does not refuse a
    config an idle one loads; each regex call gets a wall-clock ``timeout`` of
    :data:`WALL_PER_CPU` times what is left (the GIL is released while it runs).
    """

    def __init__(self, seconds: float | None = None):
        self.seconds = float(PATTERN_BUDGET_S if seconds is None else seconds)
        self.left = self.seconds

    def run(self, what: str, pattern: str, step: Callable[[float], _T]) -> _T:
        """``step(seconds_left)``, its time deducted.

        Raises:
            LoRAPatternTooExpensiveError: the budget is spent, before or during ``step`` (which
                raises ``TimeoutError`` for a regex that ran out of time), naming ``what``.
        """
        if self.left <= 0:
            raise self.error(what, pattern)
        start = time.thread_time()
        try:
            return step(self.left * WALL_PER_CPU + 0.05)
        except TimeoutError:
            self.left = 0.0
            raise self.error(what, pattern) from None
        finally:
            self.left -= time.thread_time() - start

    def error(self, what: str, pattern: str) -> LoRAPatternTooExpensiveError:
        return LoRAPatternTooExpensiveError(
            f"{what} {short_pattern(pattern)} is too expensive to match against the model's module "
            f"names: the patterns of one adapter config may take {self.seconds:g} s in all "
            "(nested repeats such as '(.*)*' backtrack exponentially); simplify the pattern",
            param="lora_path",
        )


def short_pattern(pattern: str, limit: int = 120) -> str:
    return repr(pattern) if len(pattern) <= limit else repr(pattern[:limit]) + "..."


def _name_key(key: str) -> list[str | None] | None:
    """A key of :data:`_NAME_KEY` as one entry per character it matches: the literal character,
    or ``None`` for a bare dot (any character); ``None`` for any other key."""
    if not _NAME_KEY.fullmatch(key):
        return None
    return [None if t == "." else t[-1] for t in _NAME_KEY_TOKEN.findall(key)]


def _name_key_matches(key: list[str | None], name: str) -> bool:
    """``re.match(rf"(.*\\.)?({key})$", name)`` for a key of :func:`_name_key` and a name without
    a newline: the name's last ``len(key)`` characters match the key and the rest is empty or ends
    with a dot."""
    n = len(key)
    if len(name) < n:
        return False
    head, tail = name[: len(name) - n], name[len(name) - n :]
    if head and not head.endswith("."):
        return False
    return all(k is None or k == c for k, c in zip(key, tail))


# ---- re's parse tree, written out for regex

_I, _M, _S, _A = (
    _sre_c.SRE_FLAG_IGNORECASE,
    _sre_c.SRE_FLAG_MULTILINE,
    _sre_c.SRE_FLAG_DOTALL,
    _sre_c.SRE_FLAG_ASCII,
)
_FLAG_LETTERS = ((_I, "i"), (_M, "m"), (_S, "s"), (_A, "a"))
_AT = {
    "AT_BEGINNING": "^",
    "AT_BEGINNING_STRING": r"\A",
    "AT_END": "$",
    "AT_END_STRING": r"\Z",
    "AT_BOUNDARY": r"\b",
    # re's \B does not match in an empty string (before Python 3.14); regex's does
    "AT_NON_BOUNDARY": r"\B" if re.fullmatch(r"\B", "") else r"(?:(?!\A\Z)\B)",
}
_CATEGORY = {
    "CATEGORY_DIGIT": r"\d",
    "CATEGORY_NOT_DIGIT": r"\D",
    "CATEGORY_SPACE": r"\s",
    "CATEGORY_NOT_SPACE": r"\S",
    "CATEGORY_WORD": r"\w",
    "CATEGORY_NOT_WORD": r"\W",
}
_ASCII_CHARS = [chr(c) for c in range(128)]


class _Unsupported(ValueError):
    """A construct of re's parse tree that :class:`_ForRegex` does not write out."""


class _TooLarge(ValueError):
    """A pattern larger than :data:`MAX_PATTERN_UNITS` once its counted repeats are unrolled."""


def _esc(code: int) -> str:
    """One character as a pattern atom both engines read alike, in or out of a class."""
    c = chr(code)
    if c.isascii() and (c.isalnum() or c == "_"):
        return c
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def _letters(flags: int) -> str:
    return "".join(ch for bit, ch in _FLAG_LETTERS if flags & bit)


class _ForRegex:
    """Write one pattern parsed by ``re`` as a ``regex`` (VERSION0) pattern with re's meaning."""

    def __init__(self, parsed):
        self.names = {gid: name for name, gid in parsed.state.groupdict.items()}
        self.units = 0

    def seq(self, items, flags: int, mult: int) -> str:
        return "".join(self.item(op, av, flags, mult) for op, av in items)

    def _count(self, mult: int) -> None:
        self.units += mult
        if self.units > MAX_PATTERN_UNITS:
            raise _TooLarge(
                f"its counted repeats write out to more than {MAX_PATTERN_UNITS} elements"
            )

    def item(self, op, av, flags: int, mult: int) -> str:
        name = op.name
        self._count(mult)  # every node, groups too: regex unrolls (or crashes on) empty ones
        if name == "LITERAL":
            if flags & _I and av > 0x7F:
                return self.charset([("LITERAL", av)], False, flags)
            return _esc(av)
        if name == "NOT_LITERAL":
            return self.charset([("LITERAL", av)], True, flags)
        if name == "ANY":
            return "."
        if name == "IN":
            items = [(o.name, a) for o, a in av]
            negate = bool(items) and items[0][0] == "NEGATE"
            return self.charset(items[1:] if negate else items, negate, flags)
        if name == "AT":
            return _AT[av.name]
        if name == "BRANCH":
            return "(?:" + "|".join(self.seq(alt, flags, mult) for alt in av[1]) + ")"
        if name == "SUBPATTERN":
            group, add, delete, sub = av
            inner = self.seq(sub, (flags | add) & ~delete, mult)
            on, off = _letters(add), _letters(delete & ~_A)
            if on or off:
                inner = f"(?{on}{'-' + off if off else ''}:{inner})"
            if group is None:
                return f"(?:{inner})"
            gname = self.names.get(group)
            return f"(?P<{gname}>{inner})" if gname else f"({inner})"
        if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            lo, hi, sub = av
            unbounded = hi == _sre_c.MAXREPEAT
            body = self.seq(sub, flags, mult * (max(lo, 1) + (0 if hi == lo else 1)))
            quant = f"{{{lo},}}" if unbounded else f"{{{lo},{hi}}}"
            quant += {"MIN_REPEAT": "?", "POSSESSIVE_REPEAT": "+"}.get(name, "")
            return f"(?:{body}){quant}"
        if name == "GROUPREF":
            return f"(?:\\g<{av}>)"
        if name == "GROUPREF_EXISTS":
            group, yes, no = av
            out = f"(?({group}){self.seq(yes, flags, mult)}"
            return out + (f"|{self.seq(no, flags, mult)})" if no is not None else ")")
        if name in ("ASSERT", "ASSERT_NOT"):
            direction, sub = av
            head = {("ASSERT", 1): "(?=", ("ASSERT", -1): "(?<=", ("ASSERT_NOT", 1): "(?!"}.get(
                (name, direction), "(?<!"
            )
            return head + self.seq(sub, flags, mult) + ")"
        if name == "ATOMIC_GROUP":
            return "(?>" + self.seq(av, flags, mult) + ")"
        raise _Unsupported(f"it uses {name}, which cannot be matched with a time bound")

    def charset(self, items: list[tuple[str, Any]], negate: bool, flags: int) -> str:
        """A character class. Where the engines could disagree on an ASCII character (``\\s``
        and ``\\x1c``-``\\x1f``; case-insensitive non-ASCII members such as ``ı`` ~ ``i``), the
        ASCII members are re's own answer and regex decides only the others."""
        parts = []
        differs = False
        for op, a in items:
            if op == "LITERAL":
                parts.append(_esc(a))
                differs |= bool(flags & _I) and a > 0x7F
            elif op == "RANGE":
                parts.append(f"{_esc(a[0])}-{_esc(a[1])}")
                differs |= bool(flags & _I) and a[1] > 0x7F
            elif op == "CATEGORY":
                parts.append(_CATEGORY[a.name])
                differs |= a.name in ("CATEGORY_SPACE", "CATEGORY_NOT_SPACE") and not flags & _A
            else:
                raise _Unsupported(f"its character class uses {op}")
        plain = ("[^" if negate else "[") + "".join(parts) + "]"
        if not differs:
            return plain
        fl = _letters(flags & (_I | _A))
        ours = re.compile((f"(?{fl})" if fl else "") + plain)
        members = "".join(_esc(ord(c)) for c in _ASCII_CHARS if ours.fullmatch(c))
        ascii_part = f"[{members}]" if members else "(?!)"
        return f"(?:(?-i:(?=[\\x00-\\x7f]){ascii_part})|(?-i:(?![\\x00-\\x7f])){plain})"


def _for_regex(pattern: str) -> str:
    """``pattern`` (valid for ``re``) written for ``regex`` VERSION0 with re's meaning.

    Raises:
        _Unsupported: a construct this cannot write out. _TooLarge: too large once unrolled.
    """
    parsed = _sre_parse.parse(pattern, 0)
    w = _ForRegex(parsed)
    body = w.seq(parsed, parsed.state.flags, 1)
    fl = _letters(parsed.state.flags)
    return (f"(?{fl})" if fl else "") + body


def _compile_for_regex(pattern: str, what: str, shown: str) -> regex.Pattern:
    """Compile ``pattern`` (valid for ``re``) for ``regex`` with re's meaning; messages show the
    config's own text ``shown`` (a key without peft's wrapping).

    Raises:
        LoRAPatternTooExpensiveError: too large once its counted repeats are unrolled.
        LoRAFormatError: it cannot be compiled for ``regex`` (nested too deeply, a construct
            that is not written out); both name ``what``.
    """
    try:
        return regex.compile(_for_regex(pattern), flags=regex.V0)
    except _TooLarge as e:
        raise LoRAPatternTooExpensiveError(
            f"{what} {short_pattern(shown)} is too expensive to match: {e}", param="lora_path"
        ) from None
    except re.error as e:
        raise LoRAFormatError(
            f"{what} {short_pattern(shown)} is not a valid regular expression ({e})",
            param="lora_path",
        ) from None
    except Exception as e:  # _Unsupported, regex.error, RecursionError, ... or a regex bug
        raise LoRAFormatError(
            f"{what} {short_pattern(shown)} cannot be matched with a time bound ({e})",
            param="lora_path",
        ) from None


class PatternMatcher:
    """One config's patterns, compiled once, matched under the config's :class:`PatternBudget`."""

    def __init__(self, budget: PatternBudget):
        self.budget = budget
        self._compiled: dict[str, regex.Pattern] = {}
        self._name_keys: dict[str, tuple[bool, list[str | None]] | None] = {}

    def _pattern(self, text: str, what: str, shown: str) -> regex.Pattern:
        compiled = self._compiled.get(text)
        if compiled is None:
            compiled = self.budget.run(
                what, shown, lambda _left: _compile_for_regex(text, what, shown)
            )
            self._compiled[text] = compiled
        return compiled

    def fullmatch(self, pattern: str, name: str, what: str) -> bool:
        """``re.fullmatch(pattern, name) is not None`` (peft's rule for a string
        ``target_modules`` / ``exclude_modules``)."""
        compiled = self._pattern(pattern, what, pattern)
        return self.budget.run(
            what,
            pattern,
            lambda left: compiled.fullmatch(name, timeout=left, concurrent=True) is not None,
        )

    def key_matches(self, key: str, name: str, what: str) -> bool:
        """``re.match(rf"(.*\\.)?({key})$", name) is not None`` (peft's ``get_pattern_key``)."""
        if key not in self._name_keys:
            # "^name" (and "name$", "^name$"): the wrapped key can only match the whole name
            anchored = key.startswith("^")
            body = key[1:] if anchored else key
            if body.endswith("$") and not body.endswith("\\$"):
                body = body[:-1]
            literal = _name_key(body)
            self._name_keys[key] = None if literal is None else (anchored, literal)
        fast = self._name_keys[key]
        if fast is not None and "\n" not in name:
            anchored, literal = fast
            if anchored:
                return len(name) == len(literal) and _name_key_matches(literal, name)
            return _name_key_matches(literal, name)
        compiled = self._pattern(rf"(.*\.)?({key})$", what, key)
        return self.budget.run(
            what, key, lambda left: compiled.match(name, timeout=left, concurrent=True) is not None
        )
