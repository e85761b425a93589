"""The unit tests mirror the package (docs/testing.md, "Layout").

Every ``test_<name>.py`` under ``test/unit/`` (but this file) is one of:

* ``test/unit/<path>/test_<name>.py``: the tests of ``sglang/multimodal_gen/<path>/<name>.py`` (a
  module) or of ``sglang/multimodal_gen/<path>/<name>/`` (a package); ``test/unit/cli/...``
  mirrors ``sglang/cli/...`` the same way;
* ``test/unit/<path>/<module>/test_<topic>.py``: more tests of the module
  ``sglang/multimodal_gen/<path>/<module>.py``, one file per topic: a family's cases
  (``lora/formats/test_flux.py``: Flux's LoRA layouts, for ``lora/formats.py``) or a topic of its
  own (``lora/manager/test_runtime_costs.py``);
* listed in :data:`EXCEPTIONS` with the reason it mirrors no module.

And every folder of tests is a package (``__init__.py``): test files of the same name live in
different folders (``lora/test_formats.py``, ``lora/formats/``), and the gloo workers, spawned,
import a test module by its dotted name. Integration tests sit in a group folder, none at the top.
"""

from __future__ import annotations

import os

import sglang.cli
import sglang.multimodal_gen

UNIT = os.path.dirname(os.path.abspath(__file__))
TEST_ROOT = os.path.dirname(UNIT)
PKG = os.path.dirname(os.path.abspath(sglang.multimodal_gen.__file__))
CLI = os.path.dirname(os.path.abspath(sglang.cli.__file__))

#: test files (relative to ``test/unit``) that mirror no single module, and why
EXCEPTIONS = {
    "test_layout.py": "this check",
    "test_package_structure.py": "the import graph of the whole package (no cycles)",
    "test_family_boundaries.py": "every shared module against every family's names and fields",
}


def _test_files(root: str) -> list[str]:
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        out += [
            os.path.relpath(os.path.join(folder, f), root)
            for f in sorted(files)
            if f.startswith("test_") and f.endswith(".py")
        ]
    return out


def mirrored(rel: str, pkg: str = PKG, cli: str = CLI) -> str | None:
    """Where the package holds what ``test/unit/<rel>`` tests (a module, a package, or the module
    of a topic folder), or ``None``."""
    *folders, filename = rel.split(os.sep)
    name = filename[len("test_") : -len(".py")]
    root = pkg
    if folders[:1] == ["cli"]:
        root, folders = cli, folders[1:]
    base = os.path.join(root, *folders)
    for candidate in (os.path.join(base, name + ".py"), os.path.join(base, name, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    if folders:  # a topic folder named after a module: test/unit/<path>/<module>/test_<topic>.py
        module = os.path.join(root, *folders[:-1], folders[-1] + ".py")
        if os.path.isfile(module):
            return module
    return None


def misplaced(root: str = UNIT) -> list[str]:
    return [rel for rel in _test_files(root) if rel not in EXCEPTIONS and mirrored(rel) is None]


def test_every_unit_test_file_mirrors_a_module_or_package():
    assert misplaced() == [], (
        "these test files mirror no module or package of sglang.multimodal_gen (or sglang.cli): "
        "move each next to the module it tests (docs/testing.md, Layout), or list it in "
        "EXCEPTIONS with the reason"
    )
    assert all(os.path.isfile(os.path.join(UNIT, rel)) for rel in EXCEPTIONS), "stale exception"


def test_the_check_finds_a_misplaced_file(tmp_path):
    good = ["test_hub.py", "cli/test_serve.py", "lora/test_manager.py", "lora/formats/test_x.py",
            "lora/manager/test_costs.py", "layers/lora/test_layer.py",
            "models/test_families.py"]  # fmt: skip
    bad = ["cli/test_manager.py", "lora/test_nothing_here.py", "lora/manager/deeper/test_x.py",
           "test_layer.py", "layers/test_layer.py", "test_lora_manager.py"]  # fmt: skip
    for rel in good + bad:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    assert sorted(misplaced(str(tmp_path))) == sorted(bad)


def test_every_test_folder_is_a_package_and_integration_tests_are_grouped():
    for top in ("unit", "integration", "fixtures"):
        for folder, dirs, files in os.walk(os.path.join(TEST_ROOT, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            if any(f.endswith(".py") for f in files):
                assert "__init__.py" in files, (
                    f"{os.path.relpath(folder, TEST_ROOT)}: no __init__.py"
                )
    top_level = [
        f for f in os.listdir(os.path.join(TEST_ROOT, "integration")) if f.startswith("test_")
    ]
    assert top_level == [], f"integration tests outside a group folder: {top_level}"
