"""Model-family declarations. Importing this package registers every family.

One line per family; a new family adds its declaration module here and touches nothing else
outside its own files.
"""

import sglang.multimodal_gen.models.families.flux  # noqa: F401
import sglang.multimodal_gen.models.families.qwen_image  # noqa: F401
import sglang.multimodal_gen.models.families.wan  # noqa: F401
import sglang.multimodal_gen.models.families.zimage  # noqa: F401
