"""Puts ``test/`` on ``sys.path``, so every test imports its helpers as ``fixtures.<module>``
(``test/fixtures/``). Session fixtures live in the ``conftest.py`` of the level that needs them
(``test/integration/conftest.py``: the tiny models and LoRA files).

``HF_HUB_OFFLINE=1`` for the whole run (set before ``huggingface_hub`` is imported, which reads it
once): no test reaches the real Hub. The download tests run their clients against a local stand-in
with the variable set back to 0 (``test/fixtures/hub_server.py``)."""

from __future__ import annotations

import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
if "huggingface_hub.constants" in sys.modules:  # imported before this file (a plugin)
    sys.modules["huggingface_hub.constants"].HF_HUB_OFFLINE = True

TEST_ROOT = os.path.dirname(os.path.abspath(__file__))
if TEST_ROOT not in sys.path:
    sys.path.insert(0, TEST_ROOT)
