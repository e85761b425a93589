"""``sglang generate`` names its ``--lora-path`` adapters as ``sglang serve`` does: by base name,
so a request field or preset that names an adapter (LTX-2's HQ preset names ``distilled``) finds
the file the user gave."""

from __future__ import annotations

from sglang.cli.generate import lora_nicknames


def test_adapters_are_named_by_their_base_name_and_kept_distinct():
    paths = ["/loras/distilled.safetensors", "style/", "Owner/Repo", "/x/style.safetensors"]
    assert lora_nicknames(paths) == ["distilled", "style", "Repo", "style_2"]
    assert lora_nicknames(["a/s.safetensors", "b/s.safetensors", "c/s"]) == ["s", "s_2", "s_3"]
    assert lora_nicknames([]) == []
