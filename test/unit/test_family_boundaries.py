"""A model family comes in through its own files: shared code never names a family, nor a field
that only a family declares.

The families and their fields are read from the registry (every registered family, present and
future): a family's words are its id's first part (``zimage``, ``flux``, ``qwen``, ``wan``) and
its fields are those its ``SamplingParams`` class adds beyond the common and video ones. The
package's source is parsed (``ast``): identifiers, attribute names, arguments, imports and string
literals count; comments and docstrings do not. Allowed: ``models/families/``, ``models/dits/``
and the modules a family's declaration points at (its ``configs/``, ``pipelines/`` modules).
"""

from __future__ import annotations

import ast
import glob
import os
import re

from sglang.multimodal_gen.configs.sampling_params import SamplingParams, VideoSamplingParams
from sglang.multimodal_gen.models.registry import list_families

PKG_ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "python")
SHARED_FIELDS = set(VideoSamplingParams.field_names()) | set(SamplingParams.field_names())


def _family_words() -> set[str]:
    return {fam.name.split("-")[0].replace("_", "").lower() for fam in list_families()}


def _family_fields() -> set[str]:
    out: set[str] = set()
    for fam in list_families():
        out |= set(fam.params_class().field_names()) - SHARED_FIELDS
    return out


def _family_modules() -> set[str]:
    """Source files a family's declaration points at, and the files named after the family
    (``<word>.py``, ``<word>_*.py``) next to them (its own files)."""
    paths: set[str] = set()
    for fam in list_families():
        dotted = [fam.pipeline, fam.sampling_params]
        for d in fam.denoisers:
            dotted += [d.config_class, d.model_class, d.name_map]
        for path in dotted:
            module = path.partition(":")[0]
            paths.add(os.path.normpath(os.path.join(PKG_ROOT, *module.split("."))) + ".py")
    # files named after the family next to its declared modules (pipelines/ltx2_two_stage.py
    # declared: pipelines/ltx2.py and pipelines/ltx2_upsample.py are its files too)
    for fam in list_families():
        word = fam.name.split("-")[0].replace("_", "").lower()
        for d in {os.path.dirname(p) for p in paths}:
            for f in glob.glob(os.path.join(d, word + "*.py")):
                stem = os.path.basename(f)[: -len(".py")]
                if stem == word or stem.startswith(word + "_"):
                    paths.add(os.path.normpath(f))
    return paths


def _allowed(path: str, own: set[str]) -> bool:
    p = path.replace(os.sep, "/")
    return "/models/families/" in p or "/models/dits/" in p or os.path.normpath(path) in own


def _words(text: str) -> set[str]:
    """Lower-case words of an identifier or a string (split at non-alphanumerics and camelCase)."""
    out: set[str] = set()
    for part in re.split(r"[^A-Za-z0-9]+", text):
        if not part:
            continue
        out.add(part.lower())
        out |= {w.lower() for w in re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+", part)}
    return out


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = body[0] if body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _names(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, text)`` of every identifier and non-docstring string literal."""
    docs = _docstrings(tree)
    out = []
    for node in ast.walk(tree):
        text = None
        if isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, ast.arg):
            text = node.arg
        elif isinstance(node, ast.keyword) and node.arg:
            text = node.arg
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            text = node.name
        elif isinstance(node, ast.alias):
            text = node.name + " " + (node.asname or "")
        elif isinstance(node, ast.ImportFrom):
            text = node.module or ""
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docs:
                text = node.value
        if text:
            out.append((getattr(node, "lineno", 0), text))
    return out


def find_violations(root: str = PKG_ROOT) -> list[str]:
    """``path:line: text`` of every place shared code names a family or a family-only field."""
    words, fields, own = _family_words(), _family_fields(), _family_modules()
    field_re = re.compile(r"\b(" + "|".join(map(re.escape, sorted(fields))) + r")\b")
    bad = []
    for d, _, files in os.walk(os.path.join(root, "sglang")):
        for f in sorted(files):
            path = os.path.join(d, f)
            if not f.endswith(".py") or _allowed(path, own):
                continue
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read(), path)
            rel = os.path.relpath(path, root)
            for line, text in _names(tree):
                if _words(text) & words or (fields and field_re.search(text)):
                    bad.append(f"{rel}:{line}: {text[:80]!r}")
    return bad


def test_the_check_sees_family_names_and_fields():
    """The check itself: a family word and a family field in code are found, in a docstring or a
    comment they are not (a check that finds nothing could be broken)."""
    assert _family_words() >= {"zimage", "flux", "qwen", "wan"}
    assert {"guidance_scale_2", "true_cfg_scale"} <= _family_fields()
    src = (
        '"""Docstring naming Flux and guidance_scale_2 is fine."""\n'
        "# a comment naming wan is fine\n"
        "def f(x):\n"
        '    """So is this: qwen."""\n'
        "    return x.guidance_scale_2\n"
        "MODEL = 'FluxPipeline'\n"
    )
    tree = ast.parse(src)
    found = [t for _, t in _names(tree) if _words(t) & _family_words() or "guidance_scale_2" in t]
    assert sorted(found) == ["FluxPipeline", "guidance_scale_2"], found


def test_shared_code_names_no_family_nor_family_field():
    bad = find_violations()
    assert not bad, "shared code names a family or a family-only field:\n" + "\n".join(bad)
