"""Our LTX-2.3 pipeline vs diffusers' LTX2Pipeline: same tiny directory, same seed, same frames
and the same sound.

The tiny LTX-2.3 directory (``models/families/tiny/ltx2.py``: gated attention, cross-attention
modulation, perturbable self-attention, per-modality caption projections) runs through the
engine at 2 steps with the model's default guidance: CFG (video 3, audio 7), STG (1, 1) (on
the tiny DiT's last block), modality isolation (3, 3), rescale 0.7 and the cross timestep. Every
frame must be within ``MIN_PSNR`` of diffusers' and the waveform within ``MIN_SNR`` once both
are 16-bit PCM; nearby wrong cases (another frame rate; modality guidance off; the audio's CFG
weight) fall outside. A second directory whose video VAE is timestep-conditioned covers the
decode noise, with the other knobs moved off their defaults. Image to video against diffusers'
``LTX2ImageToVideoPipeline`` (another image falls outside). TP 2 (gloo) equals diffusers too; ``sglang generate`` writes an MP4
whose AAC track lasts as long as the video at the vocoder's rate, and lossless frames plus
``audio.wav`` equal to the engine's.

Measured (fp32, CPU; min over frames / waveform SNR): default guidance inf / 115 dB at TP 1 and
TP 2; another frame rate (25 fps) 30.2 dB frames; modality guidance off 19.4 dB frames; the audio
guided with the video's CFG weight 33.7 dB audio. Decode-noise directory: 83.0 / 116 dB; the
wrong decode noise scale 25.0 dB frames; motion speed ignored (the mutant) 31.2 dB frames. Image
to video: 83.0 / 114 dB; the text-only video against it 17.2 dB frames (the test's wrong case,
the inverted image, is asserted below ``MIN_PSNR``); first-frame tokens at the step's
timestep (the mutant) 50.9 / 46.0 dB.
"""

from __future__ import annotations

import os
import wave

import numpy as np
import pytest
from fixtures.tiny_ltx2 import audio_snr, frame_psnrs, reference_ltx2, reference_output
from PIL import Image
from sglang.cli.main import main as sglang_main
from sglang.multimodal_gen.image_inputs import InputImage
from sglang.multimodal_gen.models.families.tiny.ltx2 import build_ltx2_dir
from sglang.multimodal_gen.outputs import Video
from sglang.multimodal_gen.runtime import DiffusionEngine

MIN_PSNR = 45.0  # every frame, against diffusers
MIN_SNR = 40.0  # the waveform, 16-bit quantized, against diffusers
# image to video: the repository's parity bar (docs/testing.md), since the image's first-frame
# tokens move the other tokens' prediction little in the tiny model (measured: their timestep t
# instead of 0 gives 50.9 dB frames / 46.0 dB audio, within the bars above)
I2V_MIN_PSNR, I2V_MIN_SNR = 70.0, 60.0
# STG on the tiny DiT's last block (the default, 28, is past its 2 blocks: STG would do nothing)
REQ = dict(prompt="a lighthouse at dusk", negative_prompt="blurry", height=32, width=32,
           num_frames=9, num_inference_steps=2, max_sequence_length=32, seed=7,
           spatio_temporal_guidance_blocks=[1])  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """``(directory, diffusers' pipeline, our TP 1 engine)`` of the tiny LTX-2.3."""
    d = build_ltx2_dir(str(tmp_path_factory.mktemp("tiny_ltx2") / "model"))
    with DiffusionEngine(d, device="cpu") as engine:
        yield d, reference_ltx2(d), engine


def _assert_matches(video: Video, frames: np.ndarray, audio: np.ndarray) -> None:
    assert min(frame_psnrs(video.frames[None], frames)) >= MIN_PSNR
    assert audio_snr(video.audio.samples[None], audio) >= MIN_SNR


def test_default_guidance_matches_diffusers(model):
    _, ref, engine = model
    spec = engine.spec
    d = spec.defaults
    assert (spec.outputs, spec.inputs, spec.frame_step, spec.spatial_factor) == (
        "video", ("text", "image"), 4, 4,
    )  # fmt: skip
    assert (d.height, d.width, d.num_frames, d.fps, d.num_inference_steps) == (
        512,
        768,
        121,
        24,
        30,
    )
    assert (d.guidance_scale, d.audio_guidance_scale, d.stg_scale, d.audio_stg_scale) == (
        3.0, 7.0, 1.0, 1.0,
    )  # fmt: skip
    assert (d.modality_scale, d.audio_modality_scale, d.guidance_rescale) == (3.0, 3.0, 0.7)
    assert d.spatio_temporal_guidance_blocks == (28,)
    assert d.use_cross_timestep is True and d.motion_speed == 1.0
    params = spec.resolve(spec.params(**REQ))
    (video,) = engine.generate(params)
    assert video.frames.shape == (9, 32, 32, 3) and video.fps == 24
    assert video.audio.sample_rate == 16000 and video.audio.channels == 2
    frames, audio = reference_output(ref, params)
    assert frames.std() > 10 and np.abs(audio).max() > 0.01
    _assert_matches(video, frames, audio)
    # nearby wrong cases: another frame rate (the positions); modality guidance off; the audio
    # guided with the video's CFG weight
    for change in (dict(fps=25), dict(modality_scale=1.0, audio_modality_scale=1.0)):
        (wrong,) = engine.generate(params.replace(**change))
        assert min(frame_psnrs(wrong.frames[None], frames)) < MIN_PSNR, change
    (wrong,) = engine.generate(params.replace(audio_guidance_scale=3.0))
    assert audio_snr(wrong.audio.samples[None], audio) < MIN_SNR


def test_decode_noise_and_other_knobs_match_diffusers(tmp_path):
    """A timestep-conditioned video VAE (decode noise and timestep), the audio's own CFG with
    the video's off, rescale off for the video, STG on two blocks, slow motion, LTX-2.0's
    timestep (``use_cross_timestep`` false)."""
    from sglang.multimodal_gen.pipelines.ltx2 import LTX2Pipeline

    d = build_ltx2_dir(str(tmp_path / "model"), seed=5, vae_timestep_conditioning=True)
    ours = LTX2Pipeline.from_pretrained(d)
    knobs = dict(guidance_scale=1.0, audio_guidance_scale=4.0, guidance_rescale=0.0,
                 audio_guidance_rescale=0.5, stg_scale=0.5, audio_stg_scale=2.0,
                 spatio_temporal_guidance_blocks=[0, 1], motion_speed=0.5,
                 use_cross_timestep=False, decode_timestep=0.05, decode_noise_scale=0.3)  # fmt: skip
    params = ours.spec.resolve(ours.spec.params(**dict(REQ, **knobs)))
    (video,) = ours(params, output_type="media")
    frames, audio = reference_output(reference_ltx2(d), params)
    _assert_matches(video, frames, audio)
    (wrong,) = ours(params.replace(decode_noise_scale=0.1), output_type="media")
    assert min(frame_psnrs(wrong.frames[None], frames)) < MIN_PSNR


def _input_image(invert: bool = False) -> InputImage:
    """A 64 x 64 RGB image with structure (gradients and a square); ``invert``: its negative."""
    y, x = np.mgrid[0:64, 0:64]
    a = np.stack([x * 4, y * 4, (x + y) * 2], -1).astype(np.uint8)
    a[8:30, 20:50] = (230, 40, 90)
    return InputImage(255 - a if invert else a, source="image")


def test_image_to_video_matches_diffusers(model):
    """The request's image as the first frame, against diffusers' ``LTX2ImageToVideoPipeline``
    on the same directory (H.264 re-compression at CRF 33, VAE mode, timestep 0 on the first
    frame's tokens, the first frame kept at every step)."""
    from diffusers import LTX2ImageToVideoPipeline

    d, _, engine = model
    params = engine.spec.resolve(engine.spec.params(**REQ, image=(_input_image(),)))
    (video,) = engine.generate(params)
    ref = LTX2ImageToVideoPipeline.from_pretrained(d)
    ref.set_progress_bar_config(disable=True)
    frames, audio = reference_output(ref, params, image=params.image[0].to_pil())
    assert min(frame_psnrs(video.frames[None], frames)) >= I2V_MIN_PSNR
    assert audio_snr(video.audio.samples[None], audio) >= I2V_MIN_SNR
    (wrong,) = engine.generate(params.replace(image=(_input_image(invert=True),)))
    assert min(frame_psnrs(wrong.frames[None], frames)) < MIN_PSNR


def test_tp2_matches_diffusers(model):
    d, ref, _ = model
    with DiffusionEngine(d, tp_size=2, device="cpu") as tp:
        params = tp.spec.resolve(tp.spec.params(**REQ))
        (video,) = tp.generate(params)
    _assert_matches(video, *reference_output(ref, params))


def test_generate_writes_mp4_with_sound_and_lossless_files(model, tmp_path):
    import av

    d, _, engine = model
    (video,) = engine.generate(engine.spec.params(**REQ))
    common = ["generate", "--model-path", d, "--prompt", REQ["prompt"], "--seed", "7",
              "--height", "32", "--width", "32", "--num-frames", "9", "--num-inference-steps",
              "2", "--negative-prompt", "blurry", "--max-sequence-length", "32",
              "--spatio-temporal-guidance-blocks", "1", "--no-progress"]  # fmt: skip
    out = tmp_path / "frames"
    assert sglang_main(common + ["--output-path", f"{out}/"]) == 0
    names = sorted(n for n in os.listdir(out / "video_000") if n.endswith(".png"))
    got = np.stack([np.asarray(Image.open(out / "video_000" / n)) for n in names])
    assert np.array_equal(got, video.frames)
    with wave.open(str(out / "video_000" / "audio.wav")) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 2, 2)
        pcm = np.frombuffer(w.readframes(w.getnframes()), np.int16).reshape(-1, 2)
    assert np.array_equal(pcm, video.audio.pcm16())
    mp4 = tmp_path / "clip.mp4"
    assert sglang_main(common + ["--output-path", str(mp4)]) == 0
    with av.open(str(mp4)) as c:
        stream = c.streams.audio[0]
        assert stream.rate == 16000 and stream.codec_context.name == "aac"
        samples = sum(f.samples for f in c.decode(stream))
    # the sound lasts as long as the video (9 frames at 24 fps): the causal audio VAE gives
    # 4 L - 3 mel frames of L latent frames at 25 per second, AAC pads up to a 1024 block
    seconds = samples / 16000
    assert abs(seconds - video.seconds) < 0.1, (seconds, video.seconds)
