"""Model-family declarations. Importing this package registers every family.

One line per family; a new family adds its declaration module here and touches nothing else
outside its own files.
"""

from sglang.multimodal_gen.models.families import (
    flux,  # noqa: F401
    zimage,  # noqa: F401
)
