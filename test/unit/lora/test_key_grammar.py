"""Which architecture a LoRA file was made for (``lora/key_grammar.py``): the family whose signature
matches most of its keys, whatever the order the families were registered in."""

from __future__ import annotations

from sglang.multimodal_gen.lora import guess_architecture
from sglang.multimodal_gen.lora.key_grammar import best_architecture


def test_guess_architecture():
    assert guess_architecture(["lora_unet_blocks_3_self_attn_q.lora_down.weight"]) == "Wan"
    assert guess_architecture(["transformer.single_transformer_blocks.0.attn.to_q"]) == "Flux"
    assert guess_architecture(["lora_unet_down_blocks_0_attentions_0"]).startswith("Stable")
    assert guess_architecture(["transformer.layers.0.attention.to_q.lora_A.weight"]) == "Z-Image"
    assert guess_architecture(["foo.bar"]) is None


# A HunyuanVideo-like file: its double blocks share Flux's ``double_blocks.N`` prefix.
_TOY_SIGNATURE = (r"double_blocks[._]\d+[._]img_attn_qkv", r"individual_token_refiner")
_TOY_KEYS = [
    "transformer.double_blocks.0.img_attn_qkv.lora_A.weight",
    "transformer.double_blocks.1.img_attn_qkv.lora_A.weight",
    "transformer.txt_in.individual_token_refiner.blocks.0.mlp.fc1.lora_A.weight",
]
_FLUX_KEYS = [
    "transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight",
    "transformer.single_transformer_blocks.1.attn.to_q.lora_A.weight",
]


def test_guess_architecture_scores_keys_whatever_the_registration_order(monkeypatch):
    """A file that two families' signatures match goes to the family matching more of its keys,
    not to the first registered (Flux's ``double_blocks`` pattern also matches the toy family's
    double-block keys; first-match-wins called such a file Flux); ties go to the signature that
    matched the longest piece of a key."""
    from sglang.multimodal_gen.models import registry

    registry.list_families()  # the served families first, as in a real process
    # a copy of the registry, restored when the test ends: the toy family does not outlive it;
    # without the real HunyuanVideo families, whose keys the toy's are
    served = {k: f for k, f in registry._FAMILIES.items() if not k.startswith("hunyuan-video")}
    monkeypatch.setattr(registry, "_FAMILIES", served)
    registry.register_family(
        registry.ModelFamily(
            name="toy-video",
            display_name="ToyVideo",
            pipeline_classes=("ToyVideoPipeline",),
            pipeline="toy.module:ToyVideoPipeline",
            denoisers=(),
            lora_signature=_TOY_SIGNATURE,
        )
    )
    assert list(registry._FAMILIES)[-1] == "toy-video"  # registered after Flux
    assert guess_architecture(_TOY_KEYS) == "ToyVideo"  # 3 keys against Flux's 2
    assert guess_architecture(_TOY_KEYS[:2]) == "ToyVideo"  # 2 each: the longer match
    assert guess_architecture(_FLUX_KEYS + _TOY_KEYS[:1]) == "Flux"  # 3 against 1
    assert guess_architecture(["lora_unet_blocks_3_self_attn_q.lora_down.weight"]) == "Wan"


def test_best_architecture_does_not_depend_on_the_order_of_the_signatures():
    flux = ("Flux", [r"(double_blocks|single_blocks|single_transformer_blocks)[._]\d+"])
    toy = ("ToyVideo", list(_TOY_SIGNATURE))
    for sigs in ([flux, toy], [toy, flux]):
        assert best_architecture(_TOY_KEYS, sigs) == "ToyVideo"
        assert best_architecture(_TOY_KEYS[:2], sigs) == "ToyVideo"
        assert best_architecture(_FLUX_KEYS + _TOY_KEYS[:1], sigs) == "Flux"
        assert best_architecture(["foo.bar"], sigs) is None
    # an exact tie (same count, same longest match) goes to the name that sorts first
    a, b = ("B-arch", [r"blocks\.0"]), ("A-arch", [r"blocks\.0"])
    assert best_architecture(["blocks.0.x"], [a, b]) == best_architecture(["blocks.0.x"], [b, a])
    assert best_architecture(["blocks.0.x"], [a, b]) == "A-arch"
