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


# ------------------------------------------------------------------ the extended tier
#: Long multi-process tests whose case the default tier covers in another test (named after
#: each), run by ``scripts/test.sh --all`` (``pytest --extended``) and not by CI's default run,
#: which must stay under 20 minutes on 2 cores. Node ids without the ``test/`` prefix.
EXTENDED = {
    # continuous batching under Ulysses 2 and CFG parallel 2 (engines of their own; the same
    # rank-0 admission under TP 2 on the shared engine: [tp2])
    "integration/batching/test_continuous_batching_tp.py::"
    "test_a_request_arriving_mid_batch_joins_the_running_loop_and_leaves_first[ulysses2]",
    "integration/batching/test_continuous_batching_tp.py::"
    "test_a_request_arriving_mid_batch_joins_the_running_loop_and_leaves_first[cfg2]",
    # compiled blocks with LoRA: five families through the 20 LoRA states (the same check on Wan:
    # test_lora_changes_do_not_recompile[wan]; the mechanism on a toy block:
    # unit/layers/lora/test_layer.py::test_adapter_and_strength_changes_do_not_recompile),
    # inductor's code per family (the traced graph's numerics: the CompileCounter cases) and the
    # TP 2 collectives in the traced block (gloo processes)
    "integration/compile/test_block_compile.py::test_lora_changes_do_not_recompile[zimage]",
    "integration/compile/test_block_compile.py::test_lora_changes_do_not_recompile[flux]",
    "integration/compile/test_block_compile.py::test_lora_changes_do_not_recompile[qwen_image]",
    "integration/compile/test_block_compile.py::test_lora_changes_do_not_recompile[hunyuan_video]",
    "integration/compile/test_block_compile.py::test_lora_changes_do_not_recompile[ltx2]",
    "integration/compile/test_block_compile.py::test_inductor_block_equals_eager[zimage]",
    "integration/compile/test_block_compile.py::test_inductor_block_equals_eager[flux]",
    "integration/compile/test_block_compile.py::test_inductor_block_equals_eager[qwen_image]",
    "integration/compile/test_block_compile.py::test_inductor_block_equals_eager[wan]",
    "integration/compile/test_block_compile.py::test_inductor_block_equals_eager[hunyuan_video]",
    "integration/compile/test_block_compile.py::test_inductor_block_equals_eager[ltx2]",
    "integration/compile/test_block_compile.py::test_tp2_collectives_trace_in_the_block",
    # MagCache on Z-Image (one joint CFG state) and its calibration against diffusers' on Flux
    # (the rule on Flux: test_flux_magcache_matches_diffusers; the calibration against
    # diffusers': unit/layers/step_cache/test_magcache.py::test_calibration_measures_diffusers_ratios)
    "integration/caching/test_magcache_parity.py::test_zimage_magcache_matches_diffusers",
    "integration/caching/test_magcache_parity.py::test_calibration_measures_diffusers_ratios",
    # TP 2 of ComfyUI FP8 files in the original layout, one scale over a fused q | k | v (TP 2 of
    # per-source scales on fused Flux layers: test_quantized_parity's test_flux_tp2_equals_tp1
    # [nvfp4]; one scale over a fused source at TP 1: this file's other tests)
    "integration/quantization/test_original_layouts.py::"
    "test_comfyui_fp8_original_layout_tp2_equals_tp1[flux]",
    "integration/quantization/test_original_layouts.py::"
    "test_comfyui_fp8_original_layout_tp2_equals_tp1[zimage]",
    # TP 4 of each DiT (TP 2 of every family: the conformance suite's engine test)
    "integration/families/test_flux_transformer_parity.py::test_tp2_and_tp4_equal_tp1",
    "integration/families/test_wan_transformer_parity.py::test_tp2_and_tp4_equal_tp1",
    "integration/families/test_qwen_image_transformer_parity.py::test_tp2_and_tp4_equal_tp1",
    "unit/layers/lora/test_wrappers.py::test_gloo_tp_matches_dense[4]",
    # a family's sequence x CFG parallelism (every layout on Z-Image: test_sequence_parallel_engine;
    # the DiTs' Ulysses / ring / USP: test_sequence_parallel_dits)
    "integration/families/test_flux_engine.py::test_sequence_and_cfg_parallel_equal_one_process",
    "integration/families/test_qwen_image_engine.py::test_cfg_and_ulysses_parallel_equal_one_process",
    "integration/families/test_wan_engine.py::test_cfg_and_ring_parallel_equal_one_process",
    "integration/parallel/test_sequence_parallel_engine.py::test_layout_equals_one_process"
    "[tp2_ulysses2]",
    "integration/parallel/test_sequence_parallel_engine.py::test_heads_that_do_not_divide",
    # Ulysses over heads it does not divide (the uneven head split at the attention layer, one
    # rank with no head, masked and unmasked: test_attention's [ulysses4_h6_h3])
    "unit/layers/test_attention.py::test_sp_attention_uneven_heads_matches_one_process"
    "[tp2_ulysses2_h6]",
    "unit/layers/test_attention.py::test_sp_attention_uneven_heads_matches_one_process[usp2x2_h3]",
    "integration/parallel/test_sequence_parallel_dits.py::test_zimage_uneven_heads_equal_one_process"
    "[tp2_ulysses2]",
    "integration/parallel/test_sequence_parallel_dits.py::test_zimage_uneven_heads_equal_one_process"
    "[ulysses4]",
    "integration/parallel/test_sequence_parallel_dits.py::test_sequence_parallel_equals_one_process"
    "[ulysses3]",
    "integration/lora/test_mixed_lora_batch.py::test_parallel_mixed_batch_equals_one_process[cfg2]",
    # torchrun's environment (the --nnodes path: the nodes case and the serving test)
    "integration/parallel/test_multinode.py::test_generate_across_processes_equals_one_process"
    "[torchrun]",
    # the demo model at TP 2 / Ulysses 2 (TP 2 serving: test_server_cli's shared engine; the demo
    # model itself: its single-process server tests)
    "integration/demo/test_demo_model_server.py::test_tp2_server_draws_prompts_and_applies_the_demo_lora",
    "integration/demo/test_demo_model_server.py::test_ulysses2_engine_draws_prompts",
    # the TP server past its graceful timeout (the single-process server's: same shutdown path)
    "integration/server/test_server_shutdown.py::test_tp_server_past_the_graceful_timeout_exits_within_a_bound",
    # the matmul precision in every TP process (rank 0's: test_kernels' other tests)
    "integration/engine/test_kernels.py::test_float32_matmul_precision_is_set_in_every_engine_process",
    # Qwen-Image-Edit-2511 at TP 2 (the Edit family at TP 2 with a LoRA: test_qwen_image_edit)
    "integration/families/test_qwen_image_edit_2511.py::test_tp2_gives_the_single_process_pixels",
    # LTX-2 at TP 2 without a LoRA, frames and sound (the same at TP 2 with a LoRA, merged and
    # dynamic: test_ltx2_lora's TP 2 test)
    "integration/families/test_ltx2_pipeline_parity.py::test_tp2_matches_diffusers",
    "integration/families/test_family_conformance.py::test_tp2_equals_one_process[ltx2]",
    # the conformance suite's TP 2 of a family that has its own TP 2 engine test in the default
    # tier (Flux: test_flux_engine's TP 2 with a kohya LoRA; Kontext: the Flux DiT, its
    # reference tokens sharded like the noise; Wan: test_wan_engine's TP 2 with a LoRA on both
    # experts; Z-Image: test_zimage_tp; Qwen-Image: test_qwen_image_engine's TP 2, merged and
    # dynamic). A family without one keeps its conformance TP 2 in the default tier.
    "integration/families/test_family_conformance.py::test_tp2_equals_one_process[flux]",
    "integration/families/test_family_conformance.py::test_tp2_equals_one_process[flux_kontext]",
    "integration/families/test_family_conformance.py::test_tp2_equals_one_process[wan]",
    "integration/families/test_family_conformance.py::test_tp2_equals_one_process[zimage]",
    "integration/families/test_family_conformance.py::test_tp2_equals_one_process[qwen-image]",
    # ring attention at engine level (ring at DiT level: test_sequence_parallel_dits[ring2]; the
    # engine's sequence-parallel plumbing: test_sequence_parallel_engine's ulysses2 and cfg2)
    "integration/parallel/test_sequence_parallel_engine.py::test_layout_equals_one_process[ring2]",
    # a TP size that does not divide the heads, refused by a launched engine (the same check:
    # test_zimage_engine_api's test_bad_model_path_and_tp_errors)
    "integration/families/test_flux_engine.py::test_tp3_refused_naming_the_heads",
    # HunyuanVideo 1.0 at TP 2 against diffusers with true CFG (the family's TP 2 against one
    # process: the conformance suite's test_tp2_equals_one_process[hunyuan-video])
    "integration/families/test_hunyuan_video_pipeline_parity.py::test_tp2_matches_diffusers",
    # HunyuanVideo 1.5's DiT under ring 2 (Ulysses 2 with the same key mask: its default test)
    "integration/families/test_hunyuan_video15_transformer_parity.py::test_ring2_equals_one_process",
    # HunyuanVideo 1.0's DiT under ring 2 (Ulysses 2 with the same key mask: its default test)
    "integration/families/test_hunyuan_video_transformer_parity.py::test_ring2_equals_one_process",
    # the HunyuanVideo 1.0 / 1.5 DiTs at TP 2 against TP 1 (each family's TP 2 through the engine,
    # DiT included, against one process: the conformance suite's test_tp2_equals_one_process)
    "integration/families/test_hunyuan_video_transformer_parity.py::test_tp2_equals_tp1",
    "integration/families/test_hunyuan_video15_transformer_parity.py::test_tp2_equals_tp1",
    # LTX-2's HQ preset against the hand-composed recipe (a minute of CPU; its fast part:
    # test_hq_preset_keeps_stage_1_audio)
    "integration/families/test_ltx2_two_stage.py::test_hq_preset_is_lightricks_hq_composition",
    # FastWan (DMD) at TP 2 / Ulysses 2 (the Wan DiT at TP 2: the conformance suite; the DMD
    # noise's rank independence: by construction, documented in pipelines/dmd.py)
    "integration/families/test_fastwan_dmd.py::test_parallel_layouts_equal_one_process[tp2]",
    "integration/families/test_fastwan_dmd.py::test_parallel_layouts_equal_one_process[ulysses2]",
    # HunyuanVideo 1.5 without its ByT5 glyph features (the features themselves: the parity
    # test's encoding comparison and its glyph prompt)
    "integration/families/test_hunyuan_video15_pipeline_parity.py::test_without_glyph_features_differs",
    # HunyuanVideo 1.0 with a musubi LoRA at TP 2 (LoRA on the shared MM-DiT blocks at TP 2:
    # test_flux_engine's TP 2 with a kohya LoRA; every HunyuanVideo layout: test_hunyuan_video_lora)
    "integration/families/test_hunyuan_video_lora.py::test_tp2_musubi_matches_diffusers",
    # LTX-2's DiT at SP 4 (Ulysses 2 x ring 2; both streams sharded: the default tier's Ulysses 2
    # and ring 2 of the same test)
    "integration/families/test_ltx2_transformer_parity.py::test_sequence_parallel_equals_one_process[ulysses2_ring2]",
    # LTX-2 at Ulysses 4: 4 video heads even, 2 audio heads uneven (two ranks attend none; the
    # uneven head split: test_attention's [ulysses4_h6_h3])
    "integration/families/test_ltx2_transformer_parity.py::test_sequence_parallel_equals_one_process[ulysses4]",
    # quantized checkpoints: Flux ModelOpt FP8 and online FP8 at TP 2 (TP 2 of the quantized
    # loader: test_flux_tp2_equals_tp1[nvfp4], whose row-parallel block scales are the hardest
    # split), and the FP8 pipelines against diffusers (each family's loader, name map and ignore
    # globs: its NVFP4 case; FP8 decoding and fused per-source scales:
    # test_flux_dit_modelopt_matches_diffusers[modelopt-fp8])
    "integration/quantization/test_quantized_parity.py::test_flux_tp2_equals_tp1[fp8]",
    "integration/quantization/test_quantized_parity.py::test_flux_tp2_equals_tp1[online-fp8]",
    "integration/quantization/test_quantized_parity.py::test_pipeline_matches_diffusers_on_dequantized_weights[flux-modelopt-fp8]",
    "integration/quantization/test_quantized_parity.py::test_pipeline_matches_diffusers_on_dequantized_weights[qwen-image-modelopt-fp8]",
    "integration/quantization/test_quantized_parity.py::test_pipeline_matches_diffusers_on_dequantized_weights[zimage-modelopt-fp8]",
    "integration/quantization/test_quantized_parity.py::test_pipeline_matches_diffusers_on_dequantized_weights[wan-modelopt-fp8]",
    # sglang generate --tp-size 2 with --transformer-path (the weight options reach the worker
    # processes; one process: test_cli_flags' other tests, the multi-node fingerprint:
    # unit/configs/test_launch_plan.py)
    "integration/quantization/test_cli_flags.py::test_tp2_workers_load_the_transformer_path",
    # an FP8 / NVFP4 base with an unmerged LoRA at TP 2 (the sharded scales and the LoRA pieces
    # at TP 2 in one process: unit/layers/lora/layer/test_quantized.py's
    # test_tp2_pieces_equal_one_process; a quantized NVFP4 Flux at TP 2 over gloo:
    # integration/quantization/test_quantized_parity.py's test_flux_tp2_equals_tp1[nvfp4])
    "integration/quantization/test_quantized_lora.py::test_tp2_unmerged_lora_equals_one_process"
    "[modelopt-fp8]",
    "integration/quantization/test_quantized_lora.py::test_tp2_unmerged_lora_equals_one_process"
    "[modelopt-nvfp4]",
    # every step-cache method under TP 2, Ulysses 2 and CFG parallelism, one two-worker engine
    # each (the default tier: the same methods through the session's TP 2 engine,
    # integration/caching/test_cache_parallel_layouts.py::test_tp2_shared_engine_equals_one_process,
    # and the sequence-parallel sums on a toy sequence,
    # unit/layers/step_cache/test_base.py::test_sequence_parallel_shards_add_their_sums_before_deciding)
    "integration/caching/test_cache_parallel_layouts.py::test_parallel_layout_equals_one_process"
    "[flux-tp2]",
    "integration/caching/test_cache_parallel_layouts.py::test_parallel_layout_equals_one_process"
    "[flux-ulysses2]",
    "integration/caching/test_cache_parallel_layouts.py::test_parallel_layout_equals_one_process"
    "[zimage-cfg2]",
    # Flux FBCache parity under true CFG, one cache state per branch (the default tier: the
    # guidance case of the same test, and test_step_cache's states per branch context)
    "integration/caching/test_fbcache_parity.py::test_flux_fbcache_matches_diffusers[true-cfg]",
    # TeaCache at TP 2 over gloo and its longer skip run (the default tier: the ranks' agreement
    # and the accumulator kept after it in test/unit/layers/step_cache/test_teacache.py, the
    # reference parity in test_flux_teacache_matches_reference[thresh-0.45-last-step])
    "integration/caching/test_teacache_parity.py::test_tp2_equals_tp1",
    "integration/caching/test_teacache_parity.py::test_flux_teacache_matches_reference[thresh-0.7]",
    # TeaCache's declarations of the other families, each under its pipeline (the default tier:
    # the declaration mechanism on Flux, test_flux_teacache_matches_reference)
    *(
        "integration/caching/test_teacache_parity.py::"
        f"test_families_declare_their_modulated_input[{name}]"
        for name in ("zimage", "qwen-image", "wan-a14b", "hunyuan-video", "hunyuan-video15", "ltx2")
    ),
}


def pytest_addoption(parser):
    parser.addoption(
        "--extended",
        action="store_true",
        help="also run the extended tier (long multi-process tests that CI's default run leaves "
        "to other tests; scripts/test.sh --all)",
    )


def pytest_collection_modifyitems(config, items):
    import pytest

    ids = {
        f"{os.path.relpath(str(item.path), TEST_ROOT).replace(os.sep, '/')}::{item.name}": item
        for item in items
    }
    # the whole suite (``pytest test``, no -k / -m): a name that no longer exists is an error
    whole = [os.path.abspath(str(a)) for a in config.args] == [TEST_ROOT] and not (
        config.getoption("keyword") or config.getoption("markexpr")
    )
    if whole:
        stale = sorted(EXTENDED - set(ids))
        if stale:
            raise pytest.UsageError(f"EXTENDED names tests that do not exist: {stale}")
    if config.getoption("--extended"):
        return
    skip = pytest.mark.skip(reason="extended tier: scripts/test.sh --all")
    for name in EXTENDED & set(ids):
        ids[name].add_marker(skip)
