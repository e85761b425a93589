"""What every model family must do, present and future: a family runs this suite by declaring
itself (``models/families/<name>.py`` with a ``build_tiny`` builder); nothing here names one.

For each registered family, on its tiny random-weight model (built by its own ``build_tiny``,
saved by diffusers):

- a request with classifier-free guidance on and two outputs equals diffusers' own pipeline of the
  model directory (``DiffusionPipeline.from_pretrained``), called with the same fields (each
  request field is passed under its own name when the reference pipeline takes it);
- LoRA: set (merged) changes the output, unset restores it bit-exactly, dynamic (unmerged) equals
  merged, a request's own composition equals the same composition set globally;
- a batch mixing a request with its own adapters, one with none and one with the global ones,
  in every order (and with a fourth row of other adapters, forwards and backwards), under a global composition merged and unmerged at a large strength: each row
  equals the request run alone;
- a batch with an extreme (accepted) adapter in one row leaves the other rows equal to
  themselves alone;
- tensor parallelism 2 equals one process.

The random adapters cover every ``nn.Linear`` of the diffusers transformer (peft keys), with
non-zero ``lora_A`` and ``lora_B``. Thresholds: ``MIN_PSNR`` against diffusers (the family parity
tests measure 70 dB and more on these models) and ``ROW_PSNR`` for a row against itself alone
(bit-equal on the CPU, where the GEMMs are row-invariant); a wrong case (the output of another
composition) is asserted far below them.
"""

from __future__ import annotations

import inspect
import itertools

import numpy as np
import pytest
import torch
from fixtures.tiny_models import output_pixels, psnr, random_peft_lora
from sglang.multimodal_gen.configs.sampling_params import SamplingParams
from sglang.multimodal_gen.errors import SGLangError
from sglang.multimodal_gen.models.registry import list_families, resolve_object
from sglang.multimodal_gen.runtime import DiffusionEngine

MIN_PSNR = 45.0  # against diffusers
ROW_PSNR = 60.0  # a batch row against the request alone (measured: bit-equal on the CPU)
FAMILIES = [f for f in list_families() if f.build_tiny]
STEPS = 2


def _ids(fam) -> str:
    return fam.name


@pytest.fixture(scope="module", params=FAMILIES, ids=_ids)
def family_model(request, tmp_path_factory):
    """``(family, model_dir, (lora_a, lora_b, lora_extreme))`` built once per family."""
    fam = request.param
    root = tmp_path_factory.mktemp(f"conformance_{fam.name}")
    model_dir = resolve_object(fam.build_tiny)(str(root / "model"))
    loras = tuple(
        random_peft_lora(model_dir, str(root / name), seed=seed, extreme=extreme)
        for name, seed, extreme in (("a", 1, False), ("b", 2, False), ("x", 3, True))
    )
    return fam, model_dir, loras


@pytest.fixture(scope="module")
def engine(family_model):
    _, model_dir, _ = family_model
    with DiffusionEngine(model_dir, device="cpu") as eng:
        yield eng


def _request(engine, **fields) -> SamplingParams:
    """A small request of the served model: every guidance weight at 4 and a negative prompt, so
    that classifier-free guidance runs whatever the family calls it (a video model: 5 frames)."""
    spec = engine.spec
    values = dict(prompt="a lighthouse at dusk", height=32, width=32, seed=7)
    values.update(num_inference_steps=STEPS, negative_prompt="blurry")
    for name in spec.params_class.field_names():
        f = spec.params_class.declared(name)
        if f.metadata.get("kind") == "scale":
            values[name] = 4.0
    if "num_frames" in spec.params_class.field_names():
        values["num_frames"] = 5
    if "image" in spec.required_inputs:  # an edit / image-to-video model: one input image
        values["image"] = (_input_image(),)
    values.update(fields)
    return spec.params(**values)


def _input_image():
    """A 64 x 64 RGB input image with structure (gradients and a square)."""
    from sglang.multimodal_gen.image_inputs import InputImage

    y, x = np.mgrid[0:64, 0:64]
    a = np.stack([x * 4, y * 4, (x + y) * 2], -1).astype(np.uint8)
    a[8:30, 20:50] = (230, 40, 90)
    return InputImage(a, source="image")


def _pixels(engine, params) -> np.ndarray:
    return output_pixels(engine.generate(params))


def _reference(model_dir: str, params: SamplingParams) -> np.ndarray:
    """diffusers' pipeline of ``model_dir`` with the request's fields under their own names."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(model_dir, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    takes = set(inspect.signature(pipe.__call__).parameters)
    kw = {k: v for k, v in params.set_fields().items() if k in takes and k != "seed"}
    if params.image:  # PIL images, as diffusers takes them
        pil = [x.to_pil() for x in params.image]
        kw["image"] = pil[0] if len(pil) == 1 else pil
    if "max_area" in takes:  # the request's size is exact (diffusers rescales to max_area)
        kw["max_area"] = params.height * params.width
    if "_auto_resize" in takes:  # the 64 x 64 input is already the tiny model's trained area
        kw["_auto_resize"] = False
    n = params.num_outputs_per_prompt
    for name in ("num_images_per_prompt", "num_videos_per_prompt"):
        if name in takes:
            kw[name] = n
    gen = torch.Generator().manual_seed(params.seed)
    try:
        out = pipe(generator=gen, output_type="np", **kw)
        frames = out.frames if hasattr(out, "frames") else out.images
    except RuntimeError:
        # a reference that cannot make n outputs in one call (diffusers 0.42's HunyuanVideo 1.5:
        # its text-to-video image features and its VAE's attention mask are sized for one
        # video): one output per call from the same generator (the noise of n outputs drawn
        # one after the other; the comparison shows whether that is the same noise)
        if n == 1:
            raise
        kw.update({k: 1 for k in ("num_images_per_prompt", "num_videos_per_prompt") if k in kw})
        gen = torch.Generator().manual_seed(params.seed)
        outs = [pipe(generator=gen, output_type="np", **kw) for _ in range(n)]
        frames = np.concatenate(
            [np.asarray(o.frames if hasattr(o, "frames") else o.images) for o in outs]
        )
    return (np.asarray(frames) * 255).round().astype("uint8")


def test_cfg_and_two_outputs_equal_diffusers(family_model, engine):
    _, model_dir, _ = family_model
    engine.unset_lora()
    params = _request(engine, num_outputs_per_prompt=2)
    got = _pixels(engine, params)
    assert got.shape[0] == 2 and not np.array_equal(got[0], got[1])
    expected = _reference(model_dir, params)
    assert psnr(got, expected) >= MIN_PSNR, psnr(got, expected)
    # nearby wrong cases fall outside the threshold: the outputs swapped, another seed
    assert psnr(got[::-1].copy(), expected) < MIN_PSNR
    assert psnr(_pixels(engine, params.replace(seed=8)), expected) < MIN_PSNR


def test_lora_set_unset_merge_and_per_request(family_model, engine):
    _, _, (a, b, _x) = family_model
    engine.unset_lora()
    params = _request(engine)
    base = _pixels(engine, params)
    engine.set_lora(["a", "b"], [a, b], strength=[0.8, 0.0], merge_mode="merge")
    merged = _pixels(engine, params)
    assert psnr(merged, base) < MIN_PSNR
    engine.unmerge_lora_weights()
    dynamic = _pixels(engine, params)
    assert psnr(dynamic, merged) >= MIN_PSNR
    engine.unset_lora()
    assert np.array_equal(_pixels(engine, params), base)  # restored bit-exactly
    own = _pixels(engine, params.replace(lora=[("a", 0.8)]))
    assert psnr(own, merged) >= MIN_PSNR
    assert psnr(_pixels(engine, params.replace(lora=[("b", 0.8)])), own) < MIN_PSNR


def _outcome(result):
    """A request's outcome: its pixels, or its error's type and param."""
    if isinstance(result, BaseException):
        return (type(result).__name__, getattr(result, "param", None))
    return output_pixels(result)


def _alone(engine, params):
    try:
        return _outcome(engine.generate(params))
    except SGLangError as e:
        return _outcome(e)


def _same(got, want, what: str) -> None:
    if isinstance(want, tuple) or isinstance(got, tuple):
        assert got == want, f"{what}: {got} vs {want}"
    else:
        assert psnr(got, want) >= ROW_PSNR, f"{what}: {psnr(got, want):.1f} dB"


@pytest.mark.parametrize("mode", ["merge", "dynamic"])
def test_mixed_batch_rows_equal_each_request_alone_in_every_order(family_model, engine, mode):
    _, _, (a, b, _x) = family_model
    engine.unset_lora()
    # a global composition at a large strength: rows that do not use it must not depend on it
    engine.set_lora(["a", "b"], [a, b], strength=[1e3, 0.0], merge_mode=mode)
    rows = {
        "own": _request(engine, prompt="a red fox", seed=11, lora=[("b", 0.9), ("a", -0.4)]),
        "none": _request(engine, prompt="a blue boat", seed=12, lora=[]),
        "global": _request(engine, prompt="a green tree", seed=13),
        "other": _request(engine, prompt="a white cat", seed=14, lora=[("b", 1.3)]),
    }
    alone = {k: _alone(engine, p) for k, p in rows.items()}
    # the wrong case: another composition of the same request is far away
    assert psnr(alone["own"], _outcome(engine.generate(rows["own"].replace(lora=[])))) < MIN_PSNR
    # every order of the three kinds of row (own adapters, none, the global ones), then all four
    # kinds forwards and backwards: every ordered pair of kinds occurs
    orders = list(itertools.permutations(["own", "none", "global"]))
    orders += [tuple(rows), tuple(rows)[::-1]]
    for order in orders:
        out = engine.generate_batch([rows[k] for k in order])
        for k, res in zip(order, out):
            _same(_outcome(res), alone[k], f"{mode}, order {order}, row {k}")
    engine.unset_lora()


def test_an_extreme_adapter_in_one_row_leaves_the_others_alone(family_model, engine):
    _, _, (a, _b, x) = family_model
    engine.unset_lora()
    engine.set_lora(["a", "x"], [a, x], strength=[0.5, 0.0])
    rows = [
        _request(engine, prompt="a red fox", seed=21, lora=[("x", 1.0)]),
        _request(engine, prompt="a blue boat", seed=22),
        _request(engine, prompt="a white cat", seed=23, lora=[("a", 1.0)]),
    ]
    alone = [_alone(engine, p) for p in rows]
    for order in ([0, 1, 2], [1, 0, 2], [2, 1, 0]):
        out = engine.generate_batch([rows[i] for i in order])
        for i, res in zip(order, out):
            _same(_outcome(res), alone[i], f"order {order}, row {i}")
    engine.unset_lora()


def test_rows_of_transposed_sizes_each_equal_themselves_alone(family_model, engine):
    """32x48 and 48x32 have the same token count: their rows may share a call only if every
    non-batched argument (positions, sizes) is the same, else each gets its own."""
    engine.unset_lora()
    wide = _request(engine, prompt="a red fox", seed=31, height=32, width=48)
    tall = _request(engine, prompt="a red fox", seed=31, height=48, width=32)
    alone = [_pixels(engine, p) for p in (wide, tall)]
    assert alone[0].shape != alone[1].shape
    for order in ([0, 1], [1, 0]):
        out = engine.generate_batch([(wide, tall)[i] for i in order])
        for i, res in zip(order, out):
            _same(_outcome(res), alone[i], f"order {order}, row {i}")


@pytest.mark.slow
def test_tp2_equals_one_process(family_model, engine):
    fam, model_dir, (a, _b, _x) = family_model
    engine.unset_lora()
    params = engine.spec.resolve(_request(engine, lora=[("a", 0.7)]))
    engine.set_lora("a", a, strength=0.0)  # loaded, not active
    one = _pixels(engine, params)
    engine.unset_lora()
    # a model that takes an optional image (image-to-image, inpainting) runs one with it too:
    # rank 0 encodes the image, every rank draws the same posterior sample
    extra = _image_request(engine)
    one_extra = _pixels(engine, extra) if extra is not None else None
    with DiffusionEngine(model_dir, tp_size=2, device="cpu") as tp:
        tp.set_lora("a", a, strength=0.0)
        two = output_pixels(tp.generate(params))
        two_extra = output_pixels(tp.generate(extra)) if extra is not None else None
    assert psnr(two, one) >= MIN_PSNR, f"{fam.name}: {psnr(two, one):.1f} dB"
    if extra is not None:
        assert psnr(two_extra, one_extra) >= MIN_PSNR, psnr(two_extra, one_extra)
        assert psnr(one_extra, one) < MIN_PSNR  # the image and mask really entered


def _image_request(engine):
    """The conformance request with the optional inputs the model takes (an image re-noised at
    strength 0.8, a mask of its right half), resolved; ``None`` when it takes none beyond
    what :func:`_request` already gives."""
    spec = engine.spec
    if "image" not in spec.inputs or "image" in spec.required_inputs:
        return None
    from sglang.multimodal_gen.image_inputs import InputImage

    fields = dict(image=(_input_image(),))
    if spec.defaults.strength is not None:
        fields["strength"] = 0.8
    if "mask" in spec.inputs:
        m = np.zeros((64, 64), np.uint8)
        m[:, 32:] = 255
        fields["mask_image"] = InputImage(m, source="mask_image")
    return spec.resolve(_request(engine, **fields))
