"""Puts ``test/`` on ``sys.path``, so every test imports its helpers as ``fixtures.<module>``
(``test/fixtures/``). Session fixtures live in the ``conftest.py`` of the level that needs them
(``test/integration/conftest.py``: the tiny models and LoRA files)."""

from __future__ import annotations

import os
import sys

TEST_ROOT = os.path.dirname(os.path.abspath(__file__))
if TEST_ROOT not in sys.path:
    sys.path.insert(0, TEST_ROOT)
