"""The bounds a LoRA file must stay within: one place for every number the loader enforces.

A LoRA file comes from outside (a request names it), so what it can make the server read, parse,
allocate and compute is bounded before the work is done, and every value that scales a delta is
checked against what trainers actually write. Each bound is generous next to real files (the
reason is given with the number); a file beyond one is refused with a
:class:`~sglang.multimodal_gen.errors.LoRAFormatError` (HTTP 400, ``param="lora_path"``) naming the
file and the entry at fault, before anything changes on the engine.

Read side (``lora/safetensors_io.py``, checked from the header, before any tensor is read):

- :data:`MAX_HEADER_BYTES`: the safetensors JSON header;
- :data:`MAX_METADATA_ENTRIES` / :data:`MAX_METADATA_BYTES`: its ``__metadata__``;
- the number of tensors: :func:`tensor_cap` of the model the file is loaded for (what the model can
  use), :data:`MAX_TENSORS` when no model is given.

Conversion side (``lora/formats.py``, per module):

- alpha: :func:`check_alpha` (``0 < alpha <= MAX_ALPHA_PER_RANK * r``);
- rank: stored at most ``min(in, out)`` of the target layer (a larger rank is folded exactly,
  see ``formats._place``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from sglang.multimodal_gen.errors import LoRAFormatError

__all__ = [
    "MAX_ALPHA_PER_RANK",
    "MAX_HEADER_BYTES",
    "MAX_METADATA_BYTES",
    "MAX_METADATA_ENTRIES",
    "MAX_TENSORS",
    "OTHER_KEYS_ALLOWANCE",
    "TENSORS_PER_SHARD",
    "check_alpha",
    "tensor_cap",
]

#: Largest safetensors JSON header read (bytes). A LoRA's header is its tensor entries (about
#: 150 bytes each: a rank-64 Flux LoRA with text encoders, ~1,500 tensors, writes ~250 KB) plus
#: its metadata (below); 16 MiB holds the largest model cap's entries several times over. The
#: length is the file's first 8 bytes, so a longer header is refused without reading it.
MAX_HEADER_BYTES = 16 << 20
#: Most ``__metadata__`` entries. kohya's sd-scripts / musubi write ~100 ``ss_*`` entries,
#: ``modelspec.*`` adds ~20, ai-toolkit, OneTrainer, SimpleTuner, VideoX-Fun a handful.
MAX_METADATA_ENTRIES = 4096
#: Most ``__metadata__`` characters (keys and values together). The largest real entries are
#: kohya's ``ss_tag_frequency`` of big datasets (hundreds of KB) and an embedded
#: ``modelspec.thumbnail`` image (a data URI, up to a few MB).
MAX_METADATA_BYTES = 8 << 20
#: Most tensors in a file read without a model to size the bound (``load_lora_state_dict`` called
#: directly): four times the largest model cap of the served families at full size.
MAX_TENSORS = 65536
#: Tensors a file may spend on one output shard of one layer, and for every extra component: a
#: LoRA pair with its alpha, ``lora_B.bias`` and ``diff_b`` is 5 (a LoKr module as many), doubled
#: for a file that carries a second expert's keys (Wan2.2's ``transformer_2.``) next to ours.
TENSORS_PER_SHARD = 10
#: Keys a file may hold that no layer of the model uses: text-encoder LoRA (T5-XXL + CLIP-L
#: ~720 keys; Qwen2.5-VL ~1,100), norm ``.diff`` entries, bundled embeddings.
OTHER_KEYS_ALLOWANCE = 4096
#: Largest ``alpha / r`` accepted. Trainers write alpha between 1 and twice the rank (kohya /
#: musubi ``network_alpha``: 1, r/2 or r; peft ``lora_alpha``: r or 2r; ai-toolkit, DiffSynth,
#: lightx2v: r); scales above 1024 only come from a broken or hostile file (an alpha of 1e38
#: passes every finiteness check and still turns each layer's output into Inf).
MAX_ALPHA_PER_RANK = 1024


def tensor_cap(shard_counts: Iterable[int]) -> int:
    """Most tensors a file loaded for a model may hold: :data:`TENSORS_PER_SHARD` for every
    output shard of every LoRA-able layer of the model's targets (``shard_counts``: one count per
    layer, e.g. 3 for a fused q/k/v layer), plus :data:`OTHER_KEYS_ALLOWANCE`."""
    return TENSORS_PER_SHARD * sum(shard_counts) + OTHER_KEYS_ALLOWANCE


def check_alpha(alpha: float, r: int, where: str) -> float:
    """``alpha`` if ``0 < alpha <= MAX_ALPHA_PER_RANK * r`` (and finite), else a refusal.

    Zero is refused too: it would make the adapter a no-op, and the two conventions disagree on
    it (kohya's loader reads an alpha of 0 as alpha = r, ComfyUI and diffusers as a scale of 0).

    Args:
        where: what to name in the message: the module and the key (``module 'x' (key
            'x.alpha')``) or the config field the alpha came from.

    Raises:
        LoRAFormatError: naming ``where``, the value and the bound (``param="lora_path"``).
    """
    bound = MAX_ALPHA_PER_RANK * r
    if not (math.isfinite(alpha) and 0 < alpha <= bound):
        if alpha < 0:
            why = "for the opposite effect, give a negative strength"
        elif alpha == 0:
            why = "it would make the adapter a no-op, and loaders disagree on what 0 means"
        else:
            why = "trainers write 1 to 2 x rank"
        raise LoRAFormatError(
            f"{where}: alpha {alpha:g} is out of range; LoRA alpha must satisfy 0 < alpha <= "
            f"{MAX_ALPHA_PER_RANK} x rank (rank {r}: at most {bound}) ({why})",
            param="lora_path",
        )
    return alpha
