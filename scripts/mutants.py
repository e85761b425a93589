#!/usr/bin/env python3
"""Deliberate-bug check: does the test suite catch small, plausible bugs in the code that matters?

Each mutant below is one small edit (an exact source snippet and its replacement) of a place where
a bug would silently produce wrong numbers or accept a bad request: shard maps and bias placement of
the parallel linear layers, LoRA slicing / compose / merge / unmerge, scale and alpha resolution,
the Z-Image name map, merge-cache keys, request validation, decode rounding, the schedule shift.
For every mutant the repository is copied to a temporary directory, the edit is applied there, and
``python -m pytest -x -q <tests>`` runs in the copy with ``PYTHONPATH=<copy>/python`` so the copy's
code is what gets imported (the package is installed editable from the working tree; the script
checks which ``sglang`` the copy imports before it starts). A mutant is *caught* when its tests
fail, *survived* when they pass, *stale* when its snippet is no longer in the file (the code moved
on: update the mutant), *ambiguous* when the snippet occurs more than once.

Usage::

    python scripts/mutants.py                 # baseline run, then every mutant, then the table
    python scripts/mutants.py --list          # the mutants, their files and tests, stale or not
    python scripts/mutants.py --only NAME     # one mutant (repeat the flag, or NAME1,NAME2)
    python scripts/mutants.py --jobs 2        # mutants in parallel (default 1)
    python scripts/mutants.py --report out.md --json out.json

Exit status: 0 when every selected mutant was caught, 1 when one survived or is stale/ambiguous,
2 when the unmutated tests fail (the baseline; the results would mean nothing).
See docs/testing.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "python/sglang/multimodal_gen/"
COPY_ITEMS = ("python", "test", "pyproject.toml")
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", ".pytest_cache")

# test selections (paths relative to the repository root)
LINEAR = ("test/unit/layers/test_linear.py",)
LORA_TP = ("test/unit/layers/lora/test_wrappers.py",)
NOT_GLOO = ("-k", "not gloo")  # the simulated-TP tests cover the same cases in one process
NAMES = ("test/unit/models/dits/test_zimage_names.py", "test/unit/lora/formats/test_zimage.py")
CACHE = ("test/unit/lora/test_merge_cache.py",)
PEFT = ("test/unit/lora/test_peft_config.py", "test/unit/lora/test_patterns.py")
REQUEST = ("test/unit/configs/sampling_params/test_validate.py",)
PROTOCOL = ("test/unit/entrypoints/test_protocol.py",)


@dataclass(frozen=True)
class Mutant:
    """One deliberate bug.

    Attributes:
        name: short unique name.
        files: candidate files (repository-relative); the first that contains ``old`` is mutated
            (lets a mutant follow code that moves between two known places).
        old: the exact source snippet to replace (must occur exactly once in that file).
        new: its replacement.
        tests: test files to run.
        args: extra pytest arguments (e.g. ``-k`` to skip slow multi-process variants).
        why: what the bug would do.
    """

    name: str
    files: tuple[str, ...]
    old: str
    new: str
    tests: tuple[str, ...]
    args: tuple[str, ...] = ()
    why: str = ""


def _m(name, file, old, new, tests, args=(), why=""):
    files = (file,) if isinstance(file, str) else tuple(file)
    return Mutant(name, tuple(PKG + f for f in files), old, new, tuple(tests), tuple(args), why)


MUTANTS: list[Mutant] = [
    # ------------------------------------------------------------------ layers/linear.py
    _m(
        "linear-column-rows-reversed",
        "layers/linear.py",
        'return [(None, self.output_size, self._divide(self.output_size, "output_size"), tp_rank)]',
        'return [(None, self.output_size, self._divide(self.output_size, "output_size"), '
        "self.tp_size - 1 - tp_rank)]",
        LINEAR,
        why="column-parallel rank r holds the rows of rank n-1-r",
    ),
    _m(
        "linear-merged-sections-rank0",
        "layers/linear.py",
        '(i, size, self._divide(size, f"output_sizes[{i}]"), tp_rank)',
        '(i, size, self._divide(size, f"output_sizes[{i}]"), 0)',
        LINEAR,
        why="every rank holds the first slice of gate and up",
    ),
    _m(
        "linear-qkv-kv-replica-modulo",
        "layers/linear.py",
        "kv_src = tp_rank // replicas",
        "kv_src = tp_rank % replicas",
        LINEAR,
        why="GQA: a replicated KV head is picked by rank % replicas",
    ),
    _m(
        "linear-row-bias-every-rank",
        "layers/linear.py",
        "    def _bias_on_this_rank(self):\n        return self.tp_rank == 0",
        "    def _bias_on_this_rank(self):\n        return True",
        LINEAR,
        why="row-parallel bias added on every rank, so tp times after the all-reduce",
    ),
    _m(
        "linear-input-partition-start",
        "layers/linear.py",
        "parts.append((full_off + src_index * local_size, local_size))",
        "parts.append((full_off, local_size))",
        LINEAR,
        why="every row-parallel rank reads the first input columns",
    ),
    _m(
        "linear-skip-bias-add-drops-bias",
        "layers/linear.py",
        "return y, (self.bias if self.skip_bias_add else None)",
        "return y, None",
        LINEAR,
        why="skip_bias_add returns no bias: the bias is lost",
    ),
    _m(
        "linear-gather-index-rank-offset",
        "layers/linear.py",
        "base = rank * self.output_size_per_partition",
        "base = 0",
        LINEAR,
        why="all-gathered fused outputs reordered from rank 0's block only",
    ),
    _m(
        "linear-loader-local-offset",
        "layers/linear.py",
        "param.data[local_start : local_start + local_rows].copy_(data)",
        "param.data[:local_rows].copy_(data)",
        LINEAR,
        why="a shard loaded alone (k, v, up) overwrites the first rows",
    ),
    # ------------------------------------------------------------------ layers/lora/layer.py
    _m(
        "lora-row-a-first-columns",
        "layers/lora/wrappers.py",
        "return self.base_layer.shard_input_tensor(lora_a, dim=-1)",
        "return lora_a[:, : self.base_layer.input_size_per_partition]",
        LORA_TP,
        NOT_GLOO,
        why="row-parallel LoRA A cut to the first columns on every rank",
    ),
    _m(
        "lora-column-b-fused-rows",
        "layers/lora/wrappers.py",
        "return self.base_layer.shard_output_tensor(lora_b, shard_id)",
        "return lora_b[: self.base_layer.shard_spec(shard_id).local_size]",
        LORA_TP,
        NOT_GLOO,
        why="column-parallel LoRA B cut to the first rows on every rank",
    ),
    _m(
        "lora-compose-rows-at-zero",
        "layers/lora/slots.py",
        "self.lora_b[slot, col : col + r, rows].copy_(p.lora_B.t())",
        "self.lora_b[slot, col : col + r, : p.rows].copy_(p.lora_B.t())",
        LORA_TP,
        NOT_GLOO,
        why="a slot puts every shard's B at the first rows (k/v deltas land on q)",
    ),
    _m(
        "lora-merge-ignores-scale",
        "layers/lora/compute.py",
        "acc[lo - r0 : hi - r0].addmm_(b[lo - start : hi - start].float(), a, alpha=eff)",
        "acc[lo - r0 : hi - r0].addmm_(b[lo - start : hi - start].float(), a, alpha=1.0)",
        LORA_TP,
        NOT_GLOO,
        why="merged weight W + B A, without strength and alpha / r",
    ),
    _m(
        "lora-strength-ignored",
        "layers/lora/compute.py",
        "coef = (strengths[:, None] * col_scale.index_select(0, slots)).reshape(k * r)",
        "coef = col_scale.index_select(0, slots).reshape(k * r)",
        LORA_TP,
        NOT_GLOO,
        why="the user's strength is not applied to the delta",
    ),
    _m(
        "lora-unmerge-keeps-merged-weight",
        "layers/lora/layer.py",
        "        self._set_weight(snap)\n        self._snapshot = None\n",
        "        self._snapshot = None\n",
        CACHE + ("test/unit/lora/test_manager.py",),
        NOT_GLOO,
        why="unmerge forgets the snapshot without restoring the base weight",
    ),
    _m(
        "lora-offset-every-rank",
        "layers/lora/layer.py",
        "if s.lora_offset is not None and self.base_layer._bias_on_this_rank():",
        "if s.lora_offset is not None:",
        LORA_TP,
        NOT_GLOO,
        why="a row-parallel LoRA bias offset is added on every rank (tp times)",
    ),
    _m(
        "lora-merged-rows-add-delta-again",
        "layers/lora/layer.py",
        "            if self._merged_offsets:  # offsets are never merged into the weight\n"
        "                self._add_delta(None, y, local)",
        "            if True:\n                self._add_delta(x_local, y, local)",
        ("test/unit/layers/lora/test_wrappers.py", "test/unit/layers/lora/test_layer.py"),
        NOT_GLOO,
        why="rows of the merged composition add its delta on top of the merged weight",
    ),
    # ------------------------------------------------------------------ lora/peft_config.py
    _m(
        "peft-rslora-ignored",
        "lora/peft_config.py",
        "return float(alpha) / (math.sqrt(r) if use_rslora else r)",
        "return float(alpha) / r",
        PEFT,
        why="rsLoRA adapters scaled alpha / r instead of alpha / sqrt(r)",
    ),
    _m(
        "peft-alpha-pattern-ignored",
        "lora/peft_config.py",
        "alpha = float(self.alpha_pattern[key])",
        "alpha = self.lora_alpha",
        PEFT,
        why="per-module alpha_pattern ignored",
    ),
    _m(
        "peft-rank-pattern-ignored",
        "lora/peft_config.py",
        "r = int(self.rank_pattern[key])",
        "r = self.r",
        PEFT,
        why="per-module rank_pattern ignored (scale alpha / r with the wrong r)",
    ),
    _m(
        "peft-pattern-key-not-on-dot",
        "lora/patterns.py",
        '    if head and not head.endswith("."):',
        "    if False:",
        PEFT,
        why="pattern keys match inside a name segment (w2 matches feed_forward.xw2)",
    ),
    # ------------------------------------------------------------------ lora/formats.py
    _m(
        "formats-alpha-tensor-ignored",
        "lora/formats.py",
        "        value = pair.alpha.reshape(()).item()",
        "        value = pair.alpha.numel()",
        NAMES,
        why="kohya .alpha tensors ignored (scale 1 / r)",
    ),
    _m(
        "formats-config-alpha-ignored",
        "lora/formats.py",
        "    elif cfg_alpha is not None:\n        alpha = cfg_alpha\n",
        "    elif cfg_alpha is not None:\n        alpha = float(r)\n",
        ("test/unit/lora/formats/test_zimage.py",) + PEFT,
        why="lora_alpha from adapter metadata ignored (scale 1)",
    ),
    _m(
        "formats-fused-b-sections-reversed",
        "lora/formats.py",
        "a_s, b_s = _at_most_full_rank(a, b[row : row + n])",
        "a_s, b_s = _at_most_full_rank(a, b[rows - row - n : rows - row])",
        ("test/unit/lora/test_formats.py",),
        why="a fused B (qkv / w13 in one file module) split in reverse section order",
    ),
    # ------------------------------------------------------------------ models/dits/zimage_names.py
    _m(
        "names-w1-w3-swapped",
        "models/dits/zimage_names.py",
        'NameRule("feed_forward.w1", "feed_forward.w13", 0),\n'
        '        NameRule("feed_forward.w3", "feed_forward.w13", 1),',
        'NameRule("feed_forward.w1", "feed_forward.w13", 1),\n'
        '        NameRule("feed_forward.w3", "feed_forward.w13", 0),',
        NAMES,
        why="gate and up swapped in w13 (weights and LoRA alike)",
    ),
    _m(
        "names-q-k-swapped",
        "models/dits/zimage_names.py",
        'NameRule("attention.to_q", "attention.to_qkv", "q"),\n'
        '        NameRule("attention.to_k", "attention.to_qkv", "k"),',
        'NameRule("attention.to_q", "attention.to_qkv", "k"),\n'
        '        NameRule("attention.to_k", "attention.to_qkv", "q"),',
        NAMES,
        why="q and k swapped in to_qkv",
    ),
    _m(
        "names-attention-out",
        "models/dits/zimage_names.py",
        'NameRule("attention.out", "attention.to_out.0"),',
        'NameRule("attention.out", "attention.to_out"),',
        ("test/unit/models/dits/test_zimage_names.py",),
        why="original-layout attention.out mapped to a module that does not exist",
    ),
    _m(
        "names-prefix-not-stripped",
        "models/dits/zimage_names.py",
        'strip_prefixes=("model.diffusion_model.",),',
        "strip_prefixes=(),",
        ("test/unit/models/dits/test_zimage_names.py",),
        why="original checkpoints' model.diffusion_model. prefix kept",
    ),
    # ------------------------------------------------------------------ merge cache
    _m(
        "cache-key-ignores-strength",
        "lora/compose.py",
        "keys.append(AdapterKey(adapter.identity, strength, scales))",
        "keys.append(AdapterKey(adapter.identity, 1.0, scales))",
        CACHE,
        why="set_lora of the same adapter at another strength serves the stale merge",
    ),
    _m(
        "cache-key-ignores-target",
        "lora/compose.py",
        'return MergeKey(f"{target}:{module}", self._state[target].base_version, tuple(keys))',
        "return MergeKey(module, self._state[target].base_version, tuple(keys))",
        CACHE,
        why="a second target (transformer_2) gets the first target's merged weights",
    ),
    _m(
        "cache-lru-get-not-touched",
        "lora/merge_cache.py",
        "        self._entries.move_to_end(key)\n        self.hits += 1",
        "        self.hits += 1",
        CACHE,
        why="a cache hit does not make the entry most recently used",
    ),
    _m(
        "cache-evicts-newest",
        "lora/merge_cache.py",
        "_, evicted = self._entries.popitem(last=False)",
        "_, evicted = self._entries.popitem(last=True)",
        CACHE,
        why="eviction drops the most recently used entry",
    ),
    _m(
        "cache-replace-double-counts",
        "lora/merge_cache.py",
        "        if old is not None:\n            self.bytes -= _nbytes(old)",
        "        if old is not None:\n            pass",
        CACHE,
        why="replacing a key counts its bytes twice (the bound shrinks)",
    ),
    # ------------------------------------------------------------------ configs/sampling_params.py
    _m(
        "request-size-not-multiple",
        "configs/sampling_params.py",
        "if not _is_int(value) or value <= 0 or value % spatial_factor:",
        "if not _is_int(value) or value <= 0:",
        REQUEST,
        why="a height/width that is not a multiple of the VAE x patch factor is accepted",
    ),
    _m(
        "request-max-side-off-by-one",
        "configs/sampling_params.py",
        "if max_side is not None and value > max_side:",
        "if max_side is not None and value >= max_side:",
        REQUEST,
        why="the family's largest side itself is refused",
    ),
    _m(
        "request-seed-upper-bound",
        "configs/sampling_params.py",
        "not 0 <= value <= MAX_SEED:",
        "not 0 <= value <= MAX_SEED + 1:",
        REQUEST,
        why="seed 2**63 (out of torch's range) accepted",
    ),
    _m(
        "request-negative-guidance",
        "configs/sampling_params.py",
        "if not _is_number(value) or not math.isfinite(value) or value < 0:",
        "if not _is_number(value) or not math.isfinite(value):",
        REQUEST,
        why="a negative guidance_scale / true_cfg_scale / guidance_scale_2 reaches the pipeline",
    ),
    _m(
        "request-count-over-limit",
        "configs/sampling_params.py",
        "(high is not None and value > high)",
        "(high is not None and value > high + 1)",
        REQUEST,
        why="one step, frame or image more than the model's or the server's limit accepted",
    ),
    _m(
        "request-family-field-unchecked",
        "configs/sampling_params.py",
        '            elif kind == "scale":\n                check_scale(value, f.name)',
        '            elif kind == "scale" and f.name in ("guidance_scale",):\n'
        "                check_scale(value, f.name)",
        REQUEST,
        why="a family's own guidance field (true_cfg_scale, cfg_truncation...) is not checked",
    ),
    _m(
        "request-resolve-keeps-no-defaults",
        "configs/sampling_params.py",
        "        changes: dict[str, Any] = dict(fill)",
        "        changes: dict[str, Any] = {}",
        ("test/unit/configs/test_sampling_params.py",),
        ("-k", "fills_the_models_defaults"),
        why="a request's unset fields never take the model's defaults",
    ),
    # ------------------------------------------------------------------ entrypoints/protocol.py
    _m(
        "protocol-size-unbounded",
        "entrypoints/protocol.py",
        '        check_size(height, "height", spec.spatial_factor, spec.limits.max_image_size)',
        '        check_size(height, "height", spec.spatial_factor)',
        PROTOCOL,
        ("-k", "size"),
        why="a size over the server's --max-image-size is accepted",
    ),
    _m(
        "protocol-n-unbounded",
        "entrypoints/http_server.py",
        "max_num_outputs_per_prompt=args.max_images_per_request,",
        "max_num_outputs_per_prompt=None,",
        PROTOCOL,
        ("-k", "server_spec"),
        why="n above the server's --max-n accepted",
    ),
    _m(
        "protocol-steps-unbounded",
        "entrypoints/http_server.py",
        "max_inference_steps=args.max_inference_steps,",
        "max_inference_steps=None,",
        PROTOCOL,
        ("-k", "server_spec"),
        why="num_inference_steps above the server's --max-steps accepted",
    ),
    _m(
        "protocol-compression-range",
        "entrypoints/protocol.py",
        "not 0 <= body.output_compression <= 100",
        "not -1 <= body.output_compression <= 100",
        PROTOCOL,
        ("-k", "image_job_errors"),
        why="output_compression -1 reaches the encoder",
    ),
    # ------------------------------------------------------------------ pipelines
    _m(
        "decode-round-down",
        ("pipelines/common.py",),
        '(x * 255).round().astype("uint8")',
        '(x * 255).astype("uint8")',
        ("test/unit/pipelines/test_common.py",),
        why="pixels rounded down instead of to nearest (51 dB from diffusers)",
    ),
    _m(
        "zimage-mu-intercept",
        "pipelines/base.py",
        'sc.get("base_shift", 0.5),',
        'sc.get("base_shift", 0.5) + 0.05,',
        ("test/integration/families/test_zimage_pipeline_parity.py",),
        ("-k", "dynamic"),
        why="dynamic-shift mu off by 0.05 (a wrong intercept of calculate_shift)",
    ),
    _m(
        "zimage-cfg-formula",
        "pipelines/zimage.py",
        "pred = pos + w * (pos - neg)",
        "pred = neg + w * (pos - neg)",
        ("test/integration/families/test_zimage_pipeline_parity.py",),
        ("-k", "cfg"),
        why="CFG written the other common way: neg + g (pos - neg)",
    ),
    # ------------------------------------------------------------------ second-wave families
    _m(
        "linear-input-sections-contiguous",
        "layers/linear.py",
        "parts.append((full_off + src_index * local_size, local_size))",
        "parts.append((src_index * local_size, local_size))",
        ("test/integration/families/test_flux_transformer_parity.py",),
        ("-m", "not slow"),
        why="a two-sided input (Flux proj_out [attn | mlp]) read as if its sections were one",
    ),
    _m(
        "flux-final-layer-halves-not-swapped",
        "models/dits/flux_names.py",
        '_top("final_layer.adaLN_modulation.1", "norm_out.linear", row_order=(1, 0)),',
        '_top("final_layer.adaLN_modulation.1", "norm_out.linear", row_order=(0, 1)),',
        ("test/unit/lora/formats/test_flux.py",),
        why="BFL (shift, scale) LoRA rows applied to diffusers' (scale, shift) layout",
    ),
    _m(
        "flux-guidance-constant",
        "pipelines/flux.py",
        "[b], g.params.guidance_scale, device=self.device, dtype=torch.float32",
        "[b], 3.5, device=self.device, dtype=torch.float32",
        ("test/integration/families/test_flux_pipeline_parity.py",),
        why="[dev]'s embedded guidance ignoring --guidance-scale",
    ),
    _m(
        "wan-experts-swapped",
        "pipelines/wan.py",
        'return self.transformer if self._high_noise(t) else self.denoisers["transformer_2"]',
        'return self.denoisers["transformer_2"] if self._high_noise(t) else self.transformer',
        ("test/integration/families/test_wan_pipeline_parity.py",),
        ("-k", "two_experts"),
        why="the low-noise expert run on high-noise steps and the reverse",
    ),
    _m(
        "wan-guidance-2-ignored",
        "pipelines/wan.py",
        "if not self._high_noise(t) and g.params.guidance_scale_2 is not None:",
        "if False and g.params.guidance_scale_2 is not None:",
        ("test/integration/families/test_wan_pipeline_parity.py",),
        ("-k", "two_experts"),
        why="the high-noise guidance used for both experts",
    ),
    _m(
        "wan-i2v-frame-mask-unset",
        "pipelines/wan.py",
        "mask[:, :, 0] = 1",
        "mask[:, :, 0] = 0",
        ("test/integration/families/test_wan_image_to_video.py",),
        ("-k", "i2v_a14b_matches"),
        why="I2V-A14B's frame mask not marking the image's latent frame",
    ),
    _m(
        "wan-ti2v-image-tokens-noised",
        "pipelines/wan.py",
        "per_token[0] = 0",
        "per_token[0] = 1",
        ("test/integration/families/test_wan_image_to_video.py",),
        ("-k", "ti2v_image"),
        why="TI2V's image tokens given the step's timestep instead of 0",
    ),
    _m(
        "qwen-cfg-norm-not-rescaled",
        "pipelines/qwen_image.py",
        "return comb * (cond_norm / torch.norm(comb, dim=-1, keepdim=True))",
        "return comb",
        ("test/integration/families/test_qwen_image_pipeline_parity.py",),
        ("-k", "true-cfg"),
        why="true CFG without Qwen-Image's per-token norm rescale",
    ),
    # ------------------------------------------------------------------ sequence / CFG parallel
    _m(
        "ring-merge-weights-swapped",
        "layers/attention.py",
        "return out * wa + blk_out.float() * wb, new",
        "return out * wb + blk_out.float() * wa, new",
        ("test/unit/layers/test_attention.py",),
        ("-k", "ring3"),
        why="ring attention combines two key blocks with each other's softmax weights",
    ),
    _m(
        "ulysses-heads-interleaved",
        "distributed/sequence.py",
        "inp = x.reshape(b, s, u, hh, d).permute(2, 0, 1, 3, 4).reshape(u * b * s, hh, d)",
        "inp = x.reshape(b, s, hh, u, d).permute(3, 0, 1, 2, 4).reshape(u * b * s, hh, d)",
        ("test/unit/layers/test_attention.py",),
        ("-k", "ulysses2"),
        why="the Ulysses all-to-all sends each rank every u-th head instead of its block",
    ),
    _m(
        "sp-gather-rank-order",
        "distributed/sequence.py",
        "for p, n in zip(parts, self.sizes)], dim)",
        "for p, n in zip(parts[::-1], self.sizes)], dim)",
        ("test/unit/layers/test_attention.py",),
        ("-k", "ulysses2"),
        why="the sequence chunks come back in reverse rank order",
    ),
    _m(
        "cfg-parallel-same-branch",
        "pipelines/cfg_parallel.py",
        "r = get_cfg_rank()",
        "r = 0",
        ("test/integration/parallel/test_sequence_parallel_engine.py",),
        ("-k", "cfg2 and not ulysses"),
        why="both halves of the CFG group run the conditional branch",
    ),
    _m(
        "batch-rows-request-major",
        "pipelines/batching.py",
        "args[k] = _concat([p for branch in parts for p in branch])",
        "args[k] = _concat([parts[r][i] for i in range(len(group)) for r in range(rows)])",
        ("test/integration/batching/test_batching.py",),
        ("-k", "zimage_batch"),
        why="a batched CFG call mixes one request's negative rows into another's positive rows",
    ),
    _m(
        "lora-rows-merged-weight-for-every-row",
        "layers/lora/layer.py",
        "if self._merged_local is not None and local == self._merged_local:",
        "if self._merged_local is not None:",
        ("test/unit/layers/lora/test_composition.py",),
        ("-k", "not gloo"),
        why="a merged layer serves every row of a mixed batch from its merged weight",
    ),
    _m(
        "lora-rows-first-row-for-all",
        "layers/lora/layer.py",
        "locals_ = [self.local_composition(g.composition) for g in groups]",
        "locals_ = [self.local_composition(groups[0].composition) for g in groups]",
        ("test/unit/layers/lora/test_composition.py",),
        ("-k", "not gloo"),
        why="every row of a mixed batch gets the first row's adapters",
    ),
    _m(
        "batch-lora-of-first-request",
        "pipelines/batching.py",
        "    row_lora = [c.lora for _ in range(rows) for c, n in zip(group, sizes) for _ in range(n)]",
        "    row_lora = [group[0].lora for _ in range(rows) for c, n in zip(group, sizes) for _ in range(n)]",
        ("test/integration/families/test_family_conformance.py",),
        ("-k", "zimage and every_order and dynamic"),
        why="a batched call runs every row under the first request's adapters (a later lora=None "
        "request gets another tenant's adapters)",
    ),
    _m(
        "cfg-parallel-lora-not-narrowed",
        "pipelines/cfg_parallel.py",
        "row_lora = list(row_lora)[r * n // rows : (r + 1) * n // rows]",
        "row_lora = list(row_lora)",
        ("test/integration/lora/test_mixed_lora_batch.py",),
        ("-k", "parallel"),
        why="with CFG parallelism a rank applies the whole batch's row plan to its half of the rows",
    ),
    # ------------------------------------------------------------------ bugs the suite once missed
    _m(
        "wan-expert-switch-past-boundary",
        "pipelines/wan.py",
        "return b is None or bool(t >= b)",
        "return b is None or bool(t > b)",
        ("test/integration/families/test_wan_expert_boundary.py",),
        why="a step whose timestep equals the boundary runs the low-noise expert (diffusers: >=)",
    ),
    _m(
        "flux-true-cfg-rows-interleaved",
        "pipelines/flux.py",
        'embeds = cond["embeds"].repeat_interleave(n, dim=0)\n'
        '        pooled = cond["pooled"].repeat_interleave(n, dim=0)',
        'embeds = cond["embeds"].repeat(n, 1, 1)\n        pooled = cond["pooled"].repeat(n, 1)',
        ("test/integration/families/test_family_conformance.py",),
        ("-k", "flux and cfg_and_two"),
        why="two outputs under true CFG get rows [pos, neg, pos, neg] (31 dB from diffusers)",
    ),
    _m(
        "batch-ignores-unbatched-arguments",
        "pipelines/batching.py",
        "        elif not _same(v, b.args[k]):",
        "        elif False:",
        ("test/integration/families/test_family_conformance.py",),
        ("-k", "flux and transposed"),
        why="32x48 and 48x32 requests share a call and one gets the other's positions",
    ),
    _m(
        "videos-seconds-truncated",
        "entrypoints/videos.py",
        "return int(round(seconds * fps)) + 1",
        "return int(seconds * fps) + 1",
        ("test/integration/server/test_video_request_checks.py",),
        ("-k", "brought"),
        why="seconds x fps truncated (0.26 s at 10 fps: 1 frame instead of 5)",
    ),
    _m(
        "video-frames-rounded-down",
        "configs/sampling_params.py",
        'return {"num_frames": n // step * step + 1}',
        'return {"num_frames": (n - 1) // step * step + 1}',
        ("test/integration/server/test_video_request_checks.py",),
        ("-k", "brought"),
        why="8 frames become 5 where diffusers makes 9 (the job reports other frames)",
    ),
    _m(
        "batch-takes-generations-behind-set-lora",
        "entrypoints/scheduler.py",
        "                    break  # nothing after an admin call may move ahead of it",
        "                    continue",
        ("test/unit/entrypoints/test_scheduler.py",),
        why="a generation queued after set_lora joins an earlier batch and runs with the old "
        "adapters",
    ),
    # ------------------------------------------------------------------ input images over HTTP
    _m(
        "edits-mask-budget-of-its-own",
        "entrypoints/images.py",
        'masks = decode_inputs(mask_values, "mask", mask=True, **common)',
        'masks = decode_inputs(mask_values, "mask", mask=True, '
        '**{**common, "budget": ImageBudget(limits)})',
        ("test/integration/server/test_image_edits.py",),
        ("-k", "hostile"),
        why="the mask gets a byte budget of its own: a request carries twice --max-input-bytes",
    ),
    _m(
        "edits-engine-field-names-kept",
        "entrypoints/images.py",
        '_EDIT_FIELDS = {"mask_image": "mask"}',
        "_EDIT_FIELDS = {}",
        ("test/integration/server/test_image_edits.py",),
        ("-k", "field_names"),
        why="an engine error about the mask names mask_image, a field the HTTP client never sent",
    ),
    _m(
        "input-images-server-count-unchecked",
        "entrypoints/input_images.py",
        "    if len(values) > top:",
        "    if False:",
        ("test/integration/server/test_image_edits.py",),
        ("-k", "image_at_fault"),
        why="--max-input-images ignored: a request's images are all decoded before a bound applies",
    ),
    _m(
        "qwen-edit-image-latents-reversed",
        "pipelines/qwen_image_edit.py",
        'for z in cond["image_latents"]], dim=1)',
        'for z in reversed(cond["image_latents"])], dim=1)',
        ("test/integration/families/test_qwen_image_edit.py",),
        ("-k", "plus_two_images"),
        why="Plus: the images' VAE tokens in reverse order, each on the other's RoPE frame",
    ),
    _m(
        "qwen-zero-cond-index-reversed",
        "models/dits/qwen_image.py",
        "return torch.arange(s_img, device=device).unsqueeze(0) >= first",
        "return torch.arange(s_img, device=device).unsqueeze(0) < first",
        ("test/integration/families/test_qwen_image_transformer_parity.py",),
        ("-k", "zero_cond_t"),
        why="Edit-2511: the output tokens modulated with timestep 0, the condition images with t",
    ),
    _m(
        "qwen-2511-served-as-2509",
        "models/dits/qwen_image.py",
        "if self.cfg.zero_cond_t:",
        "if False:",
        ("test/integration/families/test_qwen_image_edit_2511.py",),
        ("-k", "matches_diffusers"),
        why="zero_cond_t read and dropped: a 2511 checkpoint runs with every image token at t",
    ),
    # ------------------------------------------------------------------ input images in the pipelines
    _m(
        "sdedit-whole-schedule",
        "pipelines/image_conditioning.py",
        "t_start = int(max(n - init, 0))",
        "t_start = 0",
        ("test/unit/pipelines/test_image_conditioning.py",),
        why="strength ignored: image-to-image runs every step from the image's latents",
    ),
    _m(
        "posterior-mean-only",
        "pipelines/image_conditioning.py",
        "return mean.to(device) + std.to(device) * eps",
        "return mean.to(device) + 0 * eps",
        ("test/integration/families/test_flux_image_conditioning.py",),
        ("-k", "image_to_image and 0.6"),
        why="the image latents are the posterior's mean, not diffusers' sample",
    ),
    _m(
        "flux-inpaint-no-blend",
        "pipelines/flux.py",
        "cond[INPAINT_MASK] = pack_latents(m)",
        "m = None",
        ("test/integration/families/test_flux_image_conditioning.py",),
        ("-k", "inpainting"),
        why="the mask is accepted and never used (the unmasked part is redrawn too)",
    ),
    _m(
        "qwen-image-latents-unnormalised",
        "pipelines/qwen_image.py",
        "z = ((z - mean) * inv_std)[:, :, 0]",
        "z = z[:, :, 0]",
        ("test/integration/families/test_qwen_image_image_conditioning.py",),
        ("-k", "image_to_image"),
        why="the image's latents skip the VAE's latents_mean / latents_std normalisation",
    ),
    _m(
        "sdedit-inpaint-no-blend",
        "pipelines/image_conditioning.py",
        "if INPAINT_MASK not in cond or IMAGE_LATENTS not in cond:",
        "if True:",
        ("test/integration/families/test_zimage_image_conditioning.py",),
        ("-k", "inpainting"),
        why="Z-Image / Qwen-Image: the mask is accepted and never used (the kept part redrawn)",
    ),
    _m(
        "kontext-reference-on-the-output-axis",
        "pipelines/flux_kontext.py",
        "ids[:, 0] = 1",
        "ids[:, 0] = 0",
        ("test/integration/families/test_flux_kontext.py",),
        ("-k", "edit_matches"),
        why="the reference tokens share the output's RoPE positions",
    ),
    _m(
        "text-only-model-takes-an-image",
        "configs/sampling_params.py",
        "if params.image is not None and not takes_image:",
        "if False:",
        ("test/unit/configs/sampling_params/test_inputs.py",),
        why="an image sent to a text-only model is silently ignored",
    ),
    _m(
        "res2s-arithmetic-midpoint",
        "pipelines/res2s.py",
        "sigma_mid = sigma * math.exp(-c2 * h)",
        "sigma_mid = sigma - c2 * (sigma - sigma_next)",
        ("test/unit/pipelines/test_res2s.py",),
        why="res_2s evaluates its second stage at the arithmetic, not the log-space midpoint",
    ),
    _m(
        "res2s-phi-series-off-by-one",
        "pipelines/res2s.py",
        "term *= z / (k + j + 1)",
        "term *= z / (k + j + 2)",
        ("test/unit/pipelines/test_res2s.py",),
        why="the small-h phi series drops a factor (phi_j wrong for |z| < 1, every LTX-2 step)",
    ),
    _m(
        "res2s-bongmath-anchor",
        "pipelines/res2s.py",
        "anchor = (x_mid - k * d1) / (1.0 - k)",
        "anchor = x_mid - k * d1",
        ("test/unit/pipelines/test_res2s.py",),
        why="the HQ step re-anchors on a point the substep does not come from",
    ),
    _m(
        "ltx2-upsample-normalized-in",
        "pipelines/ltx2_upsample.py",
        "x = stats.denormalize(x)",
        "x = x",
        ("test/unit/pipelines/test_ltx2_upsample.py",),
        why="LTX-2's latent upsampler runs on normalized latents (it was trained on raw VAE ones)",
    ),
    _m(
        "ltx2-two-stage-renoise-swapped",
        "pipelines/ltx2_two_stage.py",
        "video = (s * noise + (1 - s) * video).to(self.device, torch.float32)",
        "video = ((1 - s) * noise + s * video).to(self.device, torch.float32)",
        ("test/integration/families/test_ltx2_two_stage.py",),
        ("-k", "matches_diffusers"),
        why="stage 2 starts from mostly noise instead of the upsampled stage-1 video",
    ),
    _m(
        "ltx2-res2s-last-step-skips-prediction",
        "pipelines/ltx2_two_stage.py",
        "x_next = denoise(x, RES2S_TERMINAL_SIGMA).to(latents.dtype)",
        "x_next = x.to(latents.dtype)",
        ("test/integration/families/test_ltx2_two_stage.py",),
        ("-k", "res2s"),
        why="the res_2s loop stops at sigma 0.0011 without its final data prediction",
    ),
    _m(
        "ltx2-stage-2-lora-ignored",
        "pipelines/ltx2_two_stage.py",
        "output_type=output_type, lora=stage_2_lora, **common)",
        "output_type=output_type, lora=lora, **common)",
        ("test/integration/families/test_ltx2_two_stage.py",),
        ("-k", "stage_2_lora"),
        why="stage 2 runs with the request's lora, not its stage_2_lora",
    ),
    # ------------------------------------------------------------------ the LTX-2 DiT
    _m(
        "ltx2-gate-factor-dropped",
        "models/dits/ltx2_layers.py",
        "gates = 2.0 * torch.sigmoid(gate_logits)",
        "gates = torch.sigmoid(gate_logits)",
        ("test/integration/families/test_ltx2_transformer_parity.py",),
        ("-k", "every_mode"),
        why="LTX-2.3's per-head attention gate without its factor 2 (zero logits would halve)",
    ),
    _m(
        "ltx2-cross-timestep-swapped",
        "models/dits/ltx2.py",
        "video_ca_t = audio_sigma if use_cross_timestep else timestep",
        "video_ca_t = sigma if use_cross_timestep else timestep",
        ("test/integration/families/test_ltx2_transformer_parity.py",),
        ("-k", "every_mode"),
        why="use_cross_timestep modulates the video's a2v attention by its own sigma, not audio's",
    ),
    _m(
        "ltx2-stg-lerp-reversed",
        "models/dits/ltx2_layers.py",
        "out = torch.lerp(v, out, perturbation.mask.to(v.dtype))",
        "out = torch.lerp(out, v, perturbation.mask.to(v.dtype))",
        ("test/integration/families/test_ltx2_transformer_parity.py",),
        ("-k", "every_mode"),
        why="STG perturbs the items the mask keeps and keeps the ones it perturbs",
    ),
    _m(
        "ltx2-cross-rope-audio-groups",
        "models/dits/ltx2.py",
        "cfg.audio_cross_attention_dim, cfg.num_attention_heads, (ca_max,), **common",
        "cfg.audio_cross_attention_dim, cfg.audio_num_attention_heads, (ca_max,), **common",
        ("test/integration/families/test_ltx2_transformer_parity.py",),
        ("-k", "every_mode and ltx20"),
        why="split RoPE of the a2v/v2a video side grouped by the audio heads (diffusers: video)",
    ),
    _m(
        "ltx2-v2a-video-keys-not-gathered",
        "models/dits/ltx2.py",
        "rope_groups=(ca_groups_a, ca_groups_v), kv_split=xs,",
        "rope_groups=(ca_groups_a, ca_groups_v), kv_split=None,",
        ("test/integration/families/test_ltx2_transformer_parity.py",),
        ("-k", "ulysses"),
        why="under SP the audio attends only to this rank's video tokens (ranks disagree)",
    ),
    _m(
        "ltx2-original-a2v-tables-swapped",
        "models/dits/ltx2_names.py",
        'r"transformer_blocks\\.(\\d+)\\.scale_shift_table_a2v_ca_video",',
        'r"transformer_blocks\\.(\\d+)\\.scale_shift_table_a2v_ca_audio",',
        ("test/integration/families/test_ltx2_transformer_parity.py",),
        ("-k", "original"),
        why="the Lightricks names of the per-block a2v/v2a tables mapped to the wrong stream",
    ),
    # ------------------------------------------------------------------ LTX-2 pipeline
    _m(
        "ltx2-audio-guidance-takes-video-weight",
        "pipelines/ltx2.py",
        "g_a = _effective(p.audio_guidance_scale, p.guidance_scale)",
        "g_a = p.guidance_scale",
        ("test/integration/families/test_ltx2_pipeline_parity.py",),
        ("-k", "default_guidance"),
        why="the audio stream guided with the video's CFG weight (audio_guidance_scale ignored)",
    ),
    _m(
        "ltx2-modality-guidance-dropped",
        "pipelines/ltx2.py",
        "delta_v = delta_v + (mod_v - 1) * (cond_v - m_v)",
        "delta_v = delta_v + 0 * (cond_v - m_v)",
        ("test/integration/families/test_ltx2_pipeline_parity.py",),
        ("-k", "default_guidance"),
        why="the video's modality-isolation guidance term left out",
    ),
    _m(
        "ltx2-frame-rate-ignores-motion-speed",
        "pipelines/ltx2.py",
        "fps=float(p.fps) / float(p.motion_speed),",
        "fps=float(p.fps),",
        ("test/integration/families/test_ltx2_pipeline_parity.py",),
        ("-k", "decode_noise"),
        why="the DiT's positions conditioned on the playback rate, not fps / motion_speed",
    ),
    _m(
        "ltx2-i2v-first-frame-noised",
        "pipelines/ltx2.py",
        "per_token[: cond[FIRST_FRAME].shape[1]] = 0",
        "per_token[: cond[FIRST_FRAME].shape[1]] = 1",
        ("test/integration/families/test_ltx2_pipeline_parity.py",),
        ("-k", "image_to_video"),
        why="image to video: the image's first-frame tokens given the step's timestep, not 0",
    ),
    _m(
        "ltx2-decode-noise-scale-ignored",
        "pipelines/ltx2.py",
        "s = p.decode_noise_scale if p.decode_noise_scale is not None else p.decode_timestep",
        "s = p.decode_timestep",
        ("test/integration/families/test_ltx2_pipeline_parity.py",),
        ("-k", "decode_noise"),
        why="the decode noise mixed at decode_timestep whatever decode_noise_scale says",
    ),
    # ------------------------------------------------------------------ LTX-2 LoRA files
    _m(
        "ltx2-lora-a2v-gate-original-name",
        "models/dits/ltx2_names.py",
        '_top("av_ca_a2v_gate_adaln_single", "av_cross_attn_video_a2v_gate"),',
        '_top("av_ca_a2v_gate_adaln_single", "av_cross_attn_audio_v2a_gate"),',
        ("test/unit/lora/formats/test_ltx2_trainers.py",),
        ("-k", "ltx20"),
        why="a Lightricks LoRA's video a2v gate embedder lands on the audio v2a gate embedder",
    ),
    _m(
        "lora-diffusers-metadata-other-component",
        "lora/peft_config.py",
        "        if comp == component:\n            out[fld] = v",
        "        if comp != component:\n            out[fld] = v",
        ("test/unit/lora/formats/test_ltx2.py",),
        ("-k", "peft"),
        why="a pipeline-saved LoRA's transformer.lora_alpha is not read (scale alpha/r lost)",
    ),
    _m(
        "ltx2-lora-rows-not-seen-by-the-joint-call",
        "pipelines/ltx2.py",
        "        self.joint.sync_lora_context()\n",
        "",
        ("test/integration/families/test_ltx2_lora.py",),
        ("-k", "mixed"),
        why="LTX-2's joint DiT call runs without the DiT's LoRA context: per-request adapters lost",
    ),
    _m(
        "mp4-without-its-audio-track",
        "outputs.py",
        "            if audio is not None:\n                astream = container.add_stream",
        "            if False:\n                astream = container.add_stream",
        ("test/integration/server/test_ltx2_videos_api.py",),
        ("-k", "openai"),
        why="a video with sound is written as an MP4 without its AAC track (/v1/videos, CLI)",
    ),
    _m(
        "ltx2-two-stage-requests-share-a-batch",
        "configs/ltx2_sampling.py",
        "        return (*key, id(self)) if self.two_stage else key\n",
        "        return key\n",
        ("test/integration/families/test_ltx2_two_stage.py",),
        ("-k", "flags"),
        why="two two-stage LTX-2 requests get one batch key: the server batches them and the "
        "pipeline refuses the batch",
    ),
    _m(
        "rendezvous-leader-leaves-before-the-verdict-is-read",
        "distributed/multinode.py",
        "        if verdict:\n            # rank 0 hosts the store",
        "        if False:\n            # rank 0 hosts the store",
        ("test/integration/parallel/test_multinode_rendezvous.py",),
        ("-k", "other_settings"),
        why="node 0 exits as soon as it posts a refusal: the other nodes lose the store and "
        "report a connection reset instead of the refusal",
    ),
    _m(
        "generate-lora-names-collide",
        "../cli/generate.py",
        "        while name in names:\n",
        "        while False:\n",
        ("test/unit/cli/generate/test_lora_names.py",),
        why="two --lora-path files with one base name get one nickname: the second replaces the "
        "first",
    ),
    _m(
        "dmd-renoise-reuses-one-noise",
        "pipelines/dmd.py",
        "        noise = None if last else self.noise(sample.shape)\n",
        "        noise = None if last else self.__dict__.setdefault('_eps', self.noise(sample.shape))\n",
        ("test/unit/pipelines/test_dmd.py",),
        why="every DMD re-noise uses the first step's noise instead of fresh noise",
    ),
    _m(
        "dmd-last-step-returns-x_t",
        "pipelines/dmd.py",
        "    if sigma_next is None:\n        return x0\n",
        "    if sigma_next is None:\n        return sample.float()\n",
        ("test/unit/pipelines/test_dmd.py",),
        why="the last DMD step returns its noisy input instead of the x0 prediction",
    ),
    _m(
        "dmd-sigma-is-t-over-1000",
        "pipelines/dmd.py",
        "        out.append(float(sigmas[k]))\n",
        "        out.append(float(t) / n)\n",
        ("test/unit/pipelines/test_dmd.py",),
        why="DMD sigmas t / 1000 instead of the shift-8 table's entries (757 -> 0.757, not 28/37)",
    ),
    _m(
        "dmd-noise-drawn-bcthw",
        "pipelines/dmd.py",
        "    if len(shape) == 5:\n        b, c, t, h, w = shape",
        "    if False:\n        b, c, t, h, w = shape",
        ("test/unit/pipelines/test_dmd.py",),
        why="the DMD re-noise is drawn [B, C, T, H, W]: other noise than FastVideo's for a seed",
    ),
    _m(
        "dmd-guidance-not-refused",
        "pipelines/dmd.py",
        "    if w is not None and w > 1.0:\n",
        "    if False:\n",
        ("test/unit/pipelines/test_dmd.py",),
        ("-k", "guidance"),
        why="guidance_scale > 1 to a DMD model is accepted (and the pipeline then runs CFG)",
    ),
    _m(
        "fastwan-directory-runs-the-euler-scheduler",
        "pipelines/wan.py",
        "        if cls is WanPipeline and read_model_index(model_path).pipeline_class == DMD",
        "        if False and read_model_index(model_path).pipeline_class == DMD",
        ("test/integration/families/test_fastwan_dmd.py",),
        ("-k", "text_to_video"),
        why="a WanDMDPipeline directory loads as a plain WanPipeline: UniPC over 3 steps, not DMD",
    ),
    _m(
        "fastwan-ti2v-image-frame-dropped",
        "pipelines/wan.py",
        '        if "first_frame" in cond:\n            return self._with_first_frame(latents, cond)\n',
        "        if False:\n            return self._with_first_frame(latents, cond)\n",
        ("test/integration/families/test_fastwan_dmd.py",),
        ("-k", "image_to_video"),
        why="DMD TI2V: the image's latent frame is not put back after the steps (the re-noised "
        "x0 of the first frame is decoded instead of the image)",
    ),
    _m(
        "hv15-refiner-pool-ignores-the-mask",
        "models/dits/hunyuan_video_layers.py",
        "pooled = ((x * m).sum(dim=1) / m.sum(dim=1)).to(x.dtype)",
        "pooled = x.mean(dim=1)",
        ("test/integration/families/test_hunyuan_video15_transformer_parity.py",),
        ("-k", "transformer_matches_diffusers"),
        why="HunyuanVideo 1.5's token refiner pools the padding with the text: every step's "
        "conditioning depends on the prompt's padding length",
    ),
    _m(
        "hv15-byt5-given-the-text-cond-type",
        "models/dits/hunyuan_video15.py",
        "streams.append((self.context_embedder_2(ctx2.to(self.dtype)) + w[1]) * m2[..., None])",
        "streams.append((self.context_embedder_2(ctx2.to(self.dtype)) + w[0]) * m2[..., None])",
        ("test/integration/families/test_hunyuan_video15_transformer_parity.py",),
        ("-k", "transformer_matches_diffusers"),
        why="HunyuanVideo 1.5's glyph (ByT5) tokens tagged with the Qwen text's cond-type row",
    ),
    _m(
        "hv15-text-padding-attended",
        "models/dits/hunyuan_video15.py",
        "if xs.world > 1 or not bool(valid.all()):",
        "if xs.world > 1:",
        ("test/integration/families/test_hunyuan_video15_transformer_parity.py",),
        ("-k", "transformer_matches_diffusers"),
        why="HunyuanVideo 1.5 in one process attends to the text's padding keys",
    ),
    _m(
        "hv15-padding-trimmed-to-the-shortest-item",
        "models/dits/hunyuan_video15.py",
        "keep = max(int(valid.sum(dim=1).max()), 1)",
        "keep = max(int(valid.sum(dim=1).min()), 1)",
        ("test/integration/families/test_hunyuan_video15_transformer_parity.py",),
        ("-k", "transformer_matches_diffusers"),
        why="HunyuanVideo 1.5 drops real conditioning tokens of the batch's longer prompts",
    ),
    _m(
        "hv15-tencent-final-layer-rows-unswapped",
        "models/dits/hunyuan_video_names.py",
        'top_rule("final_layer.adaLN_modulation.1", "norm_out.linear", row_order=(1, 0)),',
        'top_rule("final_layer.adaLN_modulation.1", "norm_out.linear"),',
        ("test/integration/families/test_hunyuan_video15_transformer_parity.py",),
        ("-k", "tencent"),
        why="a Tencent HunyuanVideo 1.5 checkpoint's (shift, scale) output modulation loaded as "
        "(scale, shift)",
    ),
    # ------------------------------------------------------------------ HunyuanVideo 1.0 DiT
    _m(
        "hv-rope-on-text-tokens",
        "models/dits/hunyuan_video_layers.py",
        "            text_first=False,\n",
        "            text_first=True,\n",
        ("test/integration/families/test_hunyuan_video_transformer_parity.py",),
        ("-k", "matches_diffusers"),
        why="the dual-stream joint order [text, video]: RoPE (tables for the leading tokens) "
        "lands on the text tokens and part of the video",
    ),
    _m(
        "hv-text-padding-ignored",
        "models/dits/hunyuan_video.py",
        "            if bool(txt_keys.all()):\n",
        "            if True:\n",
        ("test/integration/families/test_hunyuan_video_transformer_parity.py",),
        ("-k", "matches_diffusers"),
        why="padded text tokens attended to as keys in the dual/single blocks",
    ),
    _m(
        "hv-single-block-mask-dropped",
        "layers/mmdit.py",
        "        k = apply_rope_prefix(self.norm_k(k), rope)\n        return attention(q, k, v, key_mask)",
        "        k = apply_rope_prefix(self.norm_k(k), rope)\n        return attention(q, k, v)",
        ("test/integration/families/test_hunyuan_video_transformer_parity.py",),
        ("-k", "matches_diffusers"),
        why="the single-stream blocks attend to padded text tokens (the dual blocks mask them)",
    ),
    _m(
        "hv-refiner-pool-unmasked",
        "models/dits/hunyuan_video_layers.py",
        "            pooled = ((x * m).sum(dim=1) / m.sum(dim=1)).to(x.dtype)\n",
        "            pooled = x.mean(dim=1)\n",
        ("test/integration/families/test_hunyuan_video_transformer_parity.py",),
        ("-k", "matches_diffusers"),
        why="the token refiner's pooled text feature averages the padding too",
    ),
    _m(
        "hv-final-layer-halves-not-swapped",
        "models/dits/hunyuan_video_names.py",
        'top_rule("final_layer.adaLN_modulation.1", "norm_out.linear", row_order=(1, 0))',
        'top_rule("final_layer.adaLN_modulation.1", "norm_out.linear")',
        ("test/integration/families/test_hunyuan_video_transformer_parity.py",),
        ("-k", "tencent"),
        why="Tencent's final layer (shift, scale) rows loaded as diffusers' (scale, shift)",
    ),
    _m(
        "hv-sp-text-mask-not-sharded",
        "models/dits/hunyuan_video.py",
        "key_mask = torch.cat([vid_keys, ts.local(txt_keys)], dim=1)",
        "key_mask = torch.cat([vid_keys, txt_keys[:, : ctx.shape[1]]], dim=1)",
        ("test/integration/families/test_hunyuan_video_transformer_parity.py",),
        ("-k", "ulysses"),
        why="under SP each rank takes the first text tokens' mask instead of its own chunk's",
    ),
    _m(
        "ltx2-hq-keeps-stage-2-audio",
        "pipelines/ltx2_two_stage.py",
        "kept = g.start.kept_audio if stage == 2 else None",
        "kept = None",
        ("test/integration/families/test_ltx2_two_stage.py",),
        args=("-k", "keeps_stage_1_audio"),
        why="the HQ preset outputs stage 2's audio (Lightricks' HQ pipeline decodes stage 1's)",
    ),
    _m(
        "ltx2-default-keeps-stage-1-audio",
        "pipelines/ltx2_two_stage.py",
        'return getattr(p, "two_stage_preset", None) == "hq"',
        "return True",
        ("test/integration/families/test_ltx2_two_stage.py",),
        args=("-k", "keeps_stage_1_audio"),
        why="the default two-stage recipe outputs stage 1's audio (diffusers' keeps stage 2's)",
    ),
    _m(
        "ltx2-hq-preset-lora-strength",
        "configs/ltx2_sampling.py",
        "lora=((LTX2_DISTILLED_ADAPTER, 0.25),)",
        "lora=((LTX2_DISTILLED_ADAPTER, 0.5),)",
        ("test/unit/configs/test_ltx2_sampling.py",),
        why="the HQ preset's stage 1 runs the distilled LoRA at stage 2's strength",
    ),
    _m(
        "ltx2-hq-preset-overrides-explicit",
        "configs/ltx2_sampling.py",
        "                if getattr(self, name) is None:\n",
        "                if True:\n",
        ("test/unit/configs/test_ltx2_sampling.py",),
        why="the HQ preset replaces the fields a request sets explicitly",
    ),
    _m(
        "ltx2-hq-stage-2-euler",
        "pipelines/ltx2_two_stage.py",
        'return "res2s" if flag else',
        'return "res2s" if flag and getattr(g, "stage", 0) != 2 else',
        ("test/integration/families/test_ltx2_two_stage.py",),
        args=("--extended", "-k", "lightricks_hq_composition"),
        why="the HQ preset's stage 2 steps with Euler (Lightricks' HQ runs res_2s in both stages)",
    ),
    _m(
        "dmd-noise-differs-between-ranks",
        "pipelines/dmd.py",
        "    return eps.to(device)\n",
        "    import torch.distributed as td\n\n"
        "    return (eps + (td.get_rank() if td.is_initialized() else 0)).to(device)\n",
        ("test/integration/families/test_fastwan_dmd.py",),
        ("-k", "tp2", "--extended"),
        why="each TP rank re-noises with its own noise: the ranks' latents diverge (TP 2 != TP 1)",
    ),
    _m(
        "hv15-refiner-input-trimmed-one-short",
        "models/dits/hunyuan_video_layers.py",
        "keep = int(real.max()) + 1 if real.numel() else 1",
        "keep = int(real.max()) if real.numel() else 1",
        ("test/integration/families/test_hunyuan_video15_transformer_parity.py",),
        ("-k", "transformer_matches_diffusers"),
        why="HunyuanVideo 1.5 drops the last real text token of the longest prompt before the "
        "token refiner",
    ),
    _m(
        "hunyuan-video-llama-hidden-state-minus-2",
        "pipelines/hunyuan_video.py",
        "HIDDEN_STATE_INDEX = -3",
        "HIDDEN_STATE_INDEX = -2",
        ("test/integration/families/test_hunyuan_video_pipeline_parity.py",),
        ("-k", "embedded_guidance"),
        why="HunyuanVideo reads the Llama's second-to-last hidden state instead of layer -3 "
        "(diffusers' num_hidden_layers_to_skip 2)",
    ),
    _m(
        "hunyuan-video-guidance-not-x1000",
        "pipelines/hunyuan_video.py",
        "GUIDANCE_MULTIPLIER = 1000.0",
        "GUIDANCE_MULTIPLIER = 1.0",
        ("test/integration/families/test_hunyuan_video_pipeline_parity.py",),
        ("-k", "embedded_guidance"),
        why="HunyuanVideo's embedded guidance reaches the DiT as 6 instead of 6000",
    ),
    _m(
        "hunyuan-video-template-not-cropped",
        "pipelines/hunyuan_video.py",
        'crop = int(template["crop_start"])',
        "crop = 0",
        ("test/integration/families/test_hunyuan_video_pipeline_parity.py",),
        ("-k", "embedded_guidance"),
        why="HunyuanVideo's text tokens keep the prompt template's system part (crop_start 95 "
        "ignored): the DiT attends to the template instead of the end of the prompt",
    ),
    _m(
        "hunyuan-video-shift-7-whatever-the-directory",
        "pipelines/hunyuan_video.py",
        "        scheduler = self.new_scheduler()\n        sigmas",
        "        scheduler = self.new_scheduler()\n"
        '        scheduler = type(scheduler).from_config({**scheduler.config, "shift": 7.0})\n'
        "        sigmas",
        ("test/integration/families/test_hunyuan_video_pipeline_parity.py",),
        ("-k", "fasthunyuan"),
        why="HunyuanVideo's flow shift fixed at 7: a FastHunyuan directory whose scheduler says "
        "17 is sampled with the base model's schedule",
    ),
    _m(
        "hunyuan-video-true-cfg-around-the-wrong-branch",
        "pipelines/hunyuan_video.py",
        "return neg + g.params.true_cfg_scale * (pos - neg)",
        "return pos + g.params.true_cfg_scale * (pos - neg)",
        ("test/integration/families/test_hunyuan_video_pipeline_parity.py",),
        ("-k", "true_cfg"),
        why="HunyuanVideo's true CFG extrapolates from the conditional prediction",
    ),
    # ------------------------------------------------------------------ HunyuanVideo LoRA layouts
    _m(
        "hv-lora-comfyui-txt-qkv-on-the-image-stream",
        "models/dits/hunyuan_video_names.py",
        'rule("txt_attn.qkv", "attn.to_added_qkv"),',
        'rule("txt_attn.qkv", "attn.to_qkv"),',
        ("test/unit/lora/formats/test_hunyuan_video.py",),
        ("-k", "comfyui"),
        why="a ComfyUI-named HunyuanVideo LoRA's text-stream qkv lands on the image stream's",
    ),
    _m(
        "hv15-lora-comfyui-img-mlp-on-the-text-stream",
        "models/dits/hunyuan_video_names.py",
        'rule("img_mlp.0", "ff.net.0.proj"),',
        'rule("img_mlp.0", "ff_context.net.0.proj"),',
        ("test/unit/lora/formats/test_hunyuan_video15.py",),
        ("-k", "comfyui"),
        why="a ComfyUI-named HunyuanVideo 1.5 LoRA's image MLP lands on the text stream's",
    ),
    _m(
        "lora-row-order-also-on-lora-A",
        "lora/formats.py",
        "        b = _reorder_rows(b, order)\n",
        "        b = _reorder_rows(b, order)\n        a = _reorder_rows(a, order)\n",
        ("test/unit/lora/formats/test_hunyuan_video.py",),
        ("-k", "tencent_names"),
        why="a final layer stored (shift, scale) gets its LoRA A's rank halves swapped with B's "
        "rows (diffusers' bug on Tencent names): the delta is wrong",
    ),
    _m(
        "hv-lora-guess-block-pattern-longer-than-flux",
        "models/families/hunyuan_video.py",
        'r"(double|single)_block(?=s[._]\\d)",',
        'r"(double|single)_blocks[._]\\d+[._]",',
        ("test/unit/lora/formats/test_hunyuan_video_guess.py",),
        ("-k", "diffusers_and_comfyui"),
        why="HunyuanVideo's generic block pattern outweighs Flux's: every Flux LoRA refused on "
        "another model is said to target HunyuanVideo",
    ),
    _m(
        "hv15-lora-guess-split-qkv-short",
        "models/families/hunyuan_video15.py",
        'r"double_blocks[._]\\d+[._](img|txt)_attn_[qkv](?=[._]|$).*",',
        'r"double_blocks[._]\\d+[._](img|txt)_attn_[qkv](?=[._]|$)",',
        ("test/unit/lora/formats/test_hunyuan_video_guess.py",),
        ("-k", "1_0_and_1_5"),
        why="a HunyuanVideo 1.5 double-block LoRA in Tencent's names is guessed as 1.0 (its "
        "split q/k/v no longer outweigh the names both versions share)",
    ),
    _m(
        "lora-partial-load-guess-dropped",
        "lora/formats.py",
        'seems = f" (the keys seem to target {guess})" if guess else ""',
        'seems = ""',
        ("test/unit/lora/formats/test_hunyuan_video_guess.py",),
        ("-k", "another_family"),
        why="a LoRA of a related model (HunyuanVideo 1.0 on 1.5, on Flux) is refused as a partial "
        "load without saying which model it seems to be for",
    ),
    _m(
        "hv15-qwen-last-hidden-state",
        "pipelines/hunyuan_video15.py",
        "hidden = out.hidden_states[-(SKIP_LAYERS + 1)]",
        "hidden = out.hidden_states[-1]",
        ("test/integration/families/test_hunyuan_video15_pipeline_parity.py",),
        ("-k", "encoding"),
        why="HunyuanVideo 1.5 reads the Qwen2.5-VL's last hidden state instead of the third from "
        "the end (diffusers' num_hidden_layers_to_skip 2)",
    ),
    _m(
        "hv15-cfg-original-formulation-by-default",
        "pipelines/hunyuan_video15.py",
        'base = pos if c.get("use_original_formulation", False) else neg',
        'base = neg if c.get("use_original_formulation", False) else pos',
        ("test/integration/families/test_hunyuan_video15_pipeline_parity.py",),
        ("-k", "guider"),
        why="HunyuanVideo 1.5's guidance pushes from the conditional prediction "
        "(pos + w (pos - neg)) where the guider says neg + w (pos - neg)",
    ),
    _m(
        "hv15-sigmas-end-at-zero",
        "pipelines/hunyuan_video15.py",
        "sigmas=np.linspace(1.0, 0.0, n + 1)[:-1]",
        "sigmas=np.linspace(1.0, 0.0, n)",
        ("test/integration/families/test_hunyuan_video15_pipeline_parity.py",),
        ("-k", "t2v_matches"),
        why="HunyuanVideo 1.5's schedule has its last sigma at 0 (diffusers drops the endpoint "
        "before the shift)",
    ),
    _m(
        "hv15-default-guidance-not-the-guiders",
        "pipelines/hunyuan_video15.py",
        'if "guidance_scale" in self.guider_config:',
        "if False:",
        ("test/integration/families/test_hunyuan_video15_pipeline_parity.py",),
        ("-k", "defaults"),
        why="HunyuanVideo 1.5's default guidance is the family's 6.0, not the directory's guider",
    ),
    _m(
        "hv15-glyph-duplicates-kept",
        "pipelines/hunyuan_video15.py",
        "if len(spans) > 1:",
        "if len(spans) > 2:",
        ("test/integration/families/test_hunyuan_video15_pipeline_parity.py",),
        ("-k", "glyph_text"),
        why="HunyuanVideo 1.5's ByT5 text repeats a quoted span given twice",
    ),
    _m(
        "hv15-i2v-mask-on-every-frame",
        "pipelines/hunyuan_video15.py",
        "mask[:, :, 0] = 1.0",
        "mask[:, :, :] = 1.0",
        ("test/integration/families/test_hunyuan_video15_pipeline_parity.py",),
        ("-k", "i2v"),
        why="HunyuanVideo 1.5 image to video marks every latent frame as the image's",
    ),
    _m(
        "hv15-meanflow-r-is-the-current-step",
        "pipelines/hunyuan_video15.py",
        "r = timesteps[step_index + 1] if step_index + 1 < len(timesteps) else t * 0",
        "r = t",
        ("test/integration/families/test_hunyuan_video15_pipeline_parity.py",),
        ("-k", "i2v"),
        why="HunyuanVideo 1.5's MeanFlow DiT gets the current timestep as timestep_r instead of "
        "the next one (0 at the last step)",
    ),
    # ------------------------------------------------------------------ LTX-2 DiT: audio SP
    _m(
        "ltx2-a2v-audio-keys-not-gathered",
        "models/dits/ltx2.py",
        "rope_groups=(ca_groups_v, ca_groups_a), kv_split=axs,",
        "rope_groups=(ca_groups_v, ca_groups_a), kv_split=None,",
        ("test/integration/families/test_ltx2_transformer_parity.py",),
        ("-k", "sequence_parallel and ulysses2"),
        why="under SP the video attends only to this rank's audio tokens (ranks disagree)",
    ),
    _m(
        "ltx2-audio-rope-shard-offset",
        "models/dits/ltx2.py",
        '"audio": local_seq(tables["audio"], axs),',
        '"audio": tuple(t.narrow(1, 0, axs.sizes[axs.rank]) for t in tables["audio"]),',
        ("test/integration/families/test_ltx2_transformer_parity.py",),
        ("-k", "sequence_parallel and ulysses2"),
        why="under SP every rank's audio tokens get the first shard's RoPE positions",
    ),
    _m(
        "ltx2-audio-stream-replicated",
        "models/dits/ltx2.py",
        "axs = SeqSplit.of(sa) if sa >= xs.world else SeqSplit((sa,))",
        "axs = SeqSplit((sa,))",
        ("test/integration/families/test_ltx2_transformer_parity.py",),
        ("-k", "sequence_parallel and ulysses2"),
        why="under SP every rank computes the whole audio stream (right numbers, no sharding)",
    ),
    # ------------------------------------------------------------------ quantization
    _m(
        "quant-nvfp4-nibbles-swapped",
        "layers/quantization/nvfp4.py",
        "torch.stack((packed & 0x0F, packed >> 4), dim=-1)",
        "torch.stack((packed >> 4, packed & 0x0F), dim=-1)",
        ("test/unit/layers/quantization/test_nvfp4.py",),
        why="NVFP4 element 2j read from the high nibble (ModelOpt packs it in the low one)",
    ),
    _m(
        "quant-per-tensor-scale-fills-whole-layer",
        "layers/quantization/scales.py",
        "layer.fill_shard_rows(param, _per_tensor(loaded, what), shard_id)",
        "layer.fill_shard_rows(param, _per_tensor(loaded, what), None)",
        ("test/unit/layers/quantization/test_fp8.py",),
        why="a fused layer's q/k/v per-tensor scales overwrite each other: the last source's "
        "scale on every row",
    ),
    _m(
        "quant-full-shape-check-removed",
        "layers/linear.py",
        "            if _shape(loaded) != expected_full:",
        "            if False:",
        (
            "test/unit/layers/quantization/test_nvfp4.py",
            "test/unit/models/loader/test_quantized_checkpoints.py",
        ),
        ("-k", "shape"),
        why="a block scale short of columns is sliced as far as it goes (or crashes in a copy)",
    ),
    _m(
        "quant-row-unit-columns-first-block",
        "layers/linear.py",
        "out.append(slice(start // col_unit, (start + size) // col_unit))",
        "out.append(slice(0, size // col_unit))",
        ("test/unit/layers/quantization/test_nvfp4.py",),
        why="every row-parallel rank loads the first input columns of packed weights and block "
        "scales",
    ),
    _m(
        "quant-online-fp8-fnuz-max",
        "layers/quantization/fp8.py",
        "scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))",
        "scale = torch.where(amax > 0, amax / 240.0, torch.ones_like(amax))",
        ("test/unit/layers/quantization/test_fp8.py",),
        why="online FP8 scales for e4m3fnuz's range: only 240 of e4m3fn's 448 used",
    ),
    _m(
        "quant-ignore-glob-substring",
        "models/quantization_config.py",
        "return any(fnmatch.fnmatchcase(module, p) for p in self.ignore)",
        'return any(fnmatch.fnmatchcase(module, f"*{p}") for p in self.ignore)',
        ("test/unit/models/test_quantization_config.py",),
        why="'proj_out' in ignore also leaves every block's proj_out unquantized",
    ),
    _m(
        "quant-missing-scale-unchecked",
        "models/quantization_config.py",
        "        _check_complete(config, method, [k for k, _ in entries], header)\n",
        "",
        ("test/unit/models/loader/test_quantized_checkpoints.py",),
        ("-k", "missing"),
        why="a missing weight_scale_2 is reported under our fused parameter's name, not the "
        "checkpoint key",
    ),
    _m(
        "quant-fused-mix-allowed",
        "models/quantization_config.py",
        "        if len(flags) > 1:\n            mixed",
        "        if False:\n            mixed",
        ("test/unit/models/loader/test_quantized_checkpoints.py",),
        ("-k", "mixing"),
        why="a fused layer with quantized and unquantized sources is planned by one of them",
    ),
    _m(
        "quant-metadata-first-file-only",
        "models/quantization_config.py",
        "            for k, v in (f.metadata() or {}).items():",
        "            for k, v in ({} if h.metadata else f.metadata() or {}).items():",
        ("test/unit/models/loader/test_quantized_checkpoints.py",),
        ("-k", "one_shards"),
        why="a quantization_config in a later shard's metadata is dropped: the checkpoint is "
        "loaded as unquantized",
    ),
    # ------------------------------------------------------------------ quantized-transformer flags
    _m(
        "engine-weight-options-dropped",
        "runtime/engine.py",
        "            weights=weights,\n",
        "            weights=None,\n",
        ("test/integration/quantization/test_cli_flags.py",),
        ("-k", "transformer_path_equals"),
        why="--transformer-path / --transformer-weights-path / --quantization never reach the "
        "runner: the base transformer is served",
    ),
    _m(
        "generate-transformer-weights-path-dropped",
        "../cli/generate.py",
        "        transformer_weights_path=args.transformer_weights_path,\n",
        "        transformer_weights_path=None,\n",
        ("test/integration/quantization/test_cli_flags.py",),
        ("-k", "weights_file"),
        why="sglang generate ignores --transformer-weights-path: the unquantized weights load",
    ),
    _m(
        "weight-flags-not-exclusive",
        "configs/server_args.py",
        "    if transformer_path and transformer_weights_path:\n",
        "    if False:\n",
        ("test/unit/configs/test_server_args.py", "test/unit/cli/generate/test_weight_flags.py"),
        why="--transformer-path with --transformer-weights-path is accepted at parse time (one "
        "of them silently wins, or the error comes only after the model is fetched)",
    ),
    _m(
        "fingerprint-without-weight-options",
        "configs/launch_plan.py",
        '"weights": _weights_fingerprint(runner_kwargs.get("weights")),',
        '"weights": None,',
        ("test/unit/configs/test_launch_plan.py",),
        why="two nodes started with other transformer checkpoints (or one with --quantization) "
        "join one job and shard different weights",
    ),
    _m(
        "model-info-quantization-missing",
        "runtime/runner.py",
        '"quantization": getattr(self.pipeline.transformer, "quantization", None),',
        '"quantization": None,',
        ("test/integration/quantization/test_cli_flags.py",),
        ("-k", "transformer_path_equals"),
        why="/v1/models reports a quantized transformer as unquantized",
    ),
    # ------------------------------------------------------------------ LoRA on quantized bases
    _m(
        "lora-can-merge-ignores-quantization",
        "layers/lora/layer.py",
        "            and self.base_layer.quant_method.supports_lora_merge\n",
        "",
        ("test/unit/layers/lora/layer/test_quantized.py",),
        why="an FP8 layer (a floating-point dtype) counts as mergeable: merge writes W + delta "
        "into e4m3 storage at the old scales",
    ),
    _m(
        "lora-slots-follow-stored-dtype",
        "layers/lora/layer.py",
        "self.slots.follow_dtype(self.base_layer.dtype, self.base_layer.weight.device)",
        "self.slots.follow_dtype(self.base_layer.weight.dtype, self.base_layer.weight.device)",
        ("test/unit/layers/lora/layer/test_quantized.py",),
        why="the LoRA pair is cast to the stored FP8 / packed uint8 dtype instead of the compute "
        "dtype",
    ),
    _m(
        "lora-merge-mode-not-checked-before-apply",
        "lora/manager.py",
        '        if mode == "merge":\n            for t, comp in new_comp.items():',
        "        if False:\n            for t, comp in new_comp.items():",
        ("test/integration/quantization/test_quantized_lora.py",),
        ("-k", "merge_mode_merge and nvfp4"),
        why="set_lora in merge mode on a quantized base fails inside the layers' transaction "
        "instead of a 400 naming merge_mode and the quantized weight",
    ),
    _m(
        "linear-apply-gemm-ignores-exact-weight",
        "layers/linear.py",
        "if weight is None or weight is self.weight:",
        "if True:",
        ("test/integration/quantization/test_quantized_lora.py",),
        ("-k", "auto_mode and nvfp4"),
        why="rows whose composition is not the merged one compute with the merged weight (an "
        "auto-mode model whose unquantized layers merged: a request without adapters still gets "
        "the global one there)",
    ),
    # ------------------------------------------------------------------ quantized checkpoints
    _m(
        "nvfp4-nibble-order-swapped",
        "layers/quantization/nvfp4.py",
        "codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1)",
        "codes = torch.stack((packed >> 4, packed & 0x0F), dim=-1)",
        ("test/integration/quantization/test_quantized_parity.py",),
        ("-k", "flux_dit_modelopt and nvfp4"),
        why="element 2j read from the high nibble: every NVFP4 weight is scrambled",
    ),
    _m(
        "nvfp4-row-global-scale-ignored",
        "layers/quantization/nvfp4.py",
        "g = g.reshape(-1, 1, 1) if g.numel() > 1 else g.reshape(())",
        "g = g.reshape(-1)[0]",
        ("test/integration/quantization/test_quantized_parity.py",),
        ("-k", "flux_dit_modelopt and nvfp4"),
        why="one weight_scale_2 for the whole layer: fused q/k/v sources lose their own scales",
    ),
    _m(
        "fp8-weight-scale-ignored",
        "layers/quantization/fp8.py",
        "w = layer.weight.to(torch.float32) * layer.weight_scale[:, None]",
        "w = layer.weight.to(torch.float32)",
        ("test/integration/quantization/test_quantized_parity.py",),
        ("-k", "flux_dit_modelopt and fp8"),
        why="FP8 weights dequantized without their scale",
    ),
    _m(
        "nvfp4-block-scales-not-sliced-at-tp2",
        "layers/linear.py",
        "out.append(slice(start // col_unit, (start + size) // col_unit))",
        "out.append(slice(0, size // col_unit) if col_unit == 16 else "
        "slice(start // col_unit, (start + size) // col_unit))",
        ("test/integration/quantization/test_quantized_parity.py",),
        ("-k", "tp2 and nvfp4"),
        why="every TP rank of a row-parallel layer takes the first input blocks' scales",
    ),
    _m(
        "fp8-online-scales-from-local-columns",
        "layers/quantization/fp8.py",
        "q, scale = quantize_rows_fp8(full_rows)\n        local_q = layer.take_input_columns(q, col_unit=1)",
        "q, scale = quantize_rows_fp8(layer.take_input_columns(full_rows, col_unit=1))\n"
        "        local_q = q",
        ("test/integration/quantization/test_quantized_parity.py",),
        ("--extended", "-k", "tp2 and online"),
        why="online FP8 row scales from this rank's columns: TP ranks quantize differently",
    ),
    _m(
        "loader-row-order-reads-0d-scale",
        "models/loader.py",
        "if math.prod(shape) == 1:\n        return loaded",
        "if False:\n        return loaded",
        ("test/integration/quantization/test_quantized_parity.py",),
        ("-k", "original_layout"),
        why="a 0-d per-tensor scale under a row-reordering BFL name is read with [:] (IndexError)",
    ),
    # ------------------------------------------------------------------ layers/step_cache/
    _m(
        "step-cache-rprev-updated-on-skipped-steps",
        "layers/step_cache/dbcache.py",
        "                stats[j, 2] = prev.abs().sum()\n",
        "                stats[j, 2] = prev.abs().sum()\n                st.prev = cur\n",
        ("test/unit/layers/step_cache/test_dbcache.py",),
        why="r_prev follows every step: a slow drift never adds up to a computed step",
    ),
    _m(
        "step-cache-decision-over-the-whole-batch",
        "layers/step_cache/base.py",
        "key = (id(row.cache), row.context, comp)",
        "key = (row.context, comp)",
        ("test/unit/layers/step_cache/test_dbcache.py",),
        why="one decision for every request of a batch (a request's image depends on the batch)",
    ),
    _m(
        "step-cache-state-not-keyed-on-lora",
        "layers/step_cache/base.py",
        "state_key = (seq.name, id(seq.owner), row.context, comp)",
        "state_key = (seq.name, id(seq.owner), row.context)",
        ("test/unit/layers/step_cache/test_base.py",),
        why="a residual computed under one LoRA composition is reused under another",
    ),
    _m(
        "step-cache-side-stream-not-cached",
        "layers/step_cache/dbcache.py",
        "zip(g.state.residuals, head))",
        "zip(g.state.residuals[:1], head))",
        ("test/unit/layers/step_cache/test_dbcache.py",),
        why="a skipped step leaves the text stream of dual-stream blocks at the head output",
    ),
    _m(
        "step-cache-lora-mapping-not-narrowed",
        "layers/step_cache/base.py",
        "with ctx.rows(RowMapping.of([ctx.mapping.compositions[i] for i in index])):",
        "with ctx.rows(ctx.mapping):",
        ("test/unit/layers/step_cache/test_base.py",),
        why="the computing rows of a mixed call run under the whole batch's row mapping",
    ),
    _m(
        "step-cache-cfg-branches-not-summed",
        "layers/step_cache/base.py",
        "        _all_reduce(stats, get_cfg_group())\n",
        "        pass\n",
        ("test/integration/caching/test_cache_parallel_layouts.py",),
        ("--extended", "-k", "cfg2"),
        why="under CFG parallelism a joint request's branches decide on their own rows",
    ),
    _m(
        "taylorseer-schedule-off-by-one",
        "layers/step_cache/taylorseer.py",
        "return (t - config.warmup - 1) % config.interval == 0",
        "return (t - config.warmup) % config.interval == 0",
        ("test/unit/layers/step_cache/test_taylorseer.py",),
        why="the first call after the warmup computes (diffusers predicts it), every schedule shifts",
    ),
    _m(
        "taylorseer-differences-not-divided",
        "layers/step_cache/taylorseer.py",
        "factors.append((factors[j] - prev[j]) / d)",
        "factors.append(factors[j] - prev[j])",
        ("test/unit/layers/step_cache/test_taylorseer.py",),
        why="the derivative ignores the calls between updates: a line is extrapolated too steeply",
    ),
    _m(
        "taylorseer-residual-not-added-to-head",
        "layers/step_cache/taylorseer.py",
        "out.append(h + pred.to(h.dtype))",
        "out.append(pred.to(h.dtype))",
        ("test/unit/layers/step_cache/test_taylorseer.py",),
        why="a predicted residual replaces the middle output instead of adding to the head output",
    ),
    _m(
        "taylorseer-no-factorial",
        "layers/step_cache/taylorseer.py",
        "pred = pred + factors[j] * (s**j / math.factorial(j))",
        "pred = pred + factors[j] * s**j",
        ("test/integration/caching/test_taylorseer_parity.py",),
        ("-k", "matches_diffusers"),
        why="the second-order term of the expansion is twice what Taylor (and diffusers) say",
    ),
    _m(
        "step-cache-cfg-branches-share-one-state",
        "pipelines/base.py",
        'contexts = ["joint"] * rows if self.step_cache_joint_branches else ["cond", "uncond"]',
        'contexts = ["joint"] * rows',
        ("test/integration/caching/test_fbcache_parity.py",),
        ("--extended", "-k", "true-cfg"),
        why="Flux's cond and uncond decide together (diffusers: one cache context per branch)",
    ),
    _m(
        "export-nvfp4-undeclared-float-layer",
        "models/quantized_export.py",
        '                ignore.append(key_prefix + name[: -len(".weight")])',
        "                pass",
        ("test/unit/models/test_quantized_export.py",),
        why="an NVFP4 export keeps a layer in float without declaring it: its loader refuses it",
    ),
    # ---- original (non-diffusers) layouts: Flux BFL, Wan-AI, Tongyi Z-Image, ComfyUI Qwen-Image
    _m(
        "flux-bfl-query-norm-scale-unmapped",
        "models/dits/flux_names.py",
        'r"double_blocks\\.(\\d+)\\.img_attn\\.norm\\.query_norm\\.scale",',
        'r"double_blocks\\.(\\d+)\\.img_attn\\.norm\\.query_norm\\.scale_",',
        ("test/integration/quantization/test_original_layouts.py",),
        ("-k", "flux"),
        why="BFL's query_norm.scale reaches no parameter: a full BFL / ComfyUI Flux file fails",
    ),
    _m(
        "flux-bfl-img-txt-query-norms-swapped",
        "models/dits/flux_names.py",
        'rf"{DOUBLE_BLOCKS}.\\1.attn.norm_q.weight",\n        ),\n        ParamRename(\n            r"double_blocks\\.(\\d+)\\.img_attn\\.norm\\.key_norm\\.scale",\n            rf"{DOUBLE_BLOCKS}.\\1.attn.norm_k.weight",\n        ),\n        ParamRename(\n            r"double_blocks\\.(\\d+)\\.txt_attn\\.norm\\.query_norm\\.scale",\n            rf"{DOUBLE_BLOCKS}.\\1.attn.norm_added_q.weight"',
        'rf"{DOUBLE_BLOCKS}.\\1.attn.norm_added_q.weight",\n        ),\n        ParamRename(\n            r"double_blocks\\.(\\d+)\\.img_attn\\.norm\\.key_norm\\.scale",\n            rf"{DOUBLE_BLOCKS}.\\1.attn.norm_k.weight",\n        ),\n        ParamRename(\n            r"double_blocks\\.(\\d+)\\.txt_attn\\.norm\\.query_norm\\.scale",\n            rf"{DOUBLE_BLOCKS}.\\1.attn.norm_q.weight"',
        ("test/integration/quantization/test_original_layouts.py",),
        ("-k", "flux"),
        why="BFL's image / text q-norm scales loaded into each other's norms: loads, wrong numbers",
    ),
    _m(
        "flux-bfl-single-key-norm-as-query",
        "models/dits/flux_names.py",
        'rf"{SINGLE_BLOCKS}.\\1.attn.norm_k.weight",',
        'rf"{SINGLE_BLOCKS}.\\1.attn.norm_q.weight",',
        ("test/integration/quantization/test_original_layouts.py",),
        ("-k", "flux"),
        why="a single block's key_norm.scale loads its norm_q a second time, norm_k never",
    ),
    _m(
        "name-map-param-prefix-not-stripped",
        "models/name_map.py",
        "param_name = self._strip(param_name)\n",
        "\n",
        ("test/integration/quantization/test_original_layouts.py",),
        ("-k", "zimage and comfy"),
        why="model.diffusion_model.x_pad_token splits as module 'model.diffusion_model': a "
        "prefixed (ComfyUI) Z-Image file's top-level parameters reach nothing",
    ),
    _m(
        "name-map-param-renames-ignored",
        "models/name_map.py",
        "for rename in self.param_renames:\n            out = rename.apply(param_name)",
        "for rename in ():\n            out = rename.apply(param_name)",
        ("test/integration/quantization/test_original_layouts.py",),
        ("-k", "wan-ti2v and original_layout_file"),
        why="whole-parameter renames skipped: Wan's modulation / head.modulation and BFL's "
        "query_norm.scale reach nothing",
    ),
    _m(
        "zimage-norm-final-not-unused",
        "models/dits/zimage_names.py",
        'unused=(r"norm_final\\.weight",),',
        "unused=(),",
        ("test/integration/quantization/test_original_layouts.py",),
        ("-k", "zimage and original_layout_file"),
        why="a Z-Image file in the original layout with its unused norm_final.weight is refused",
    ),
    _m(
        "linear-cast-converts-quantized-storage",
        "layers/linear.py",
        '        if self.quant_method.name == "unquantized":\n            out = super()._apply(fn, recurse)',
        "        if True:\n            out = super()._apply(fn, recurse)",
        ("test/unit/layers/linear/test_quantized_storage.py",),
        why="model.to(bf16) casts an FP8 weight and its fp32 scales: the layer is no longer quantized",
    ),
    _m(
        "fp8-gemm-probe-skipped",
        "layers/quantization/fp8.py",
        "ok = _SCALED_MM_OK[key] = capable and _probe_scaled_mm(device, dtype)",
        "ok = _SCALED_MM_OK[key] = capable",
        ("test/unit/layers/quantization/test_fp8.py",),
        ("-k", "probe"),
        why="a torch build that refuses the row-wise FP8 GEMM (fp16 outputs) fails at run time",
    ),
    _m(
        "quantization-primary-expert-only",
        "pipelines/base.py",
        "quantization=weights.quantization if weights is not None else None,",
        "quantization=opts.quantization if opts else None,",
        ("test/integration/quantization/test_two_experts.py",),
        why="--quantization fp8 quantizes one expert of a two-expert model and says nothing",
    ),
    _m(
        "weights-path-folder-config-ignored",
        "models/loader.py",
        'if "quantization_config" in own and "quantization_config" not in cfg_json:',
        "if False:",
        ("test/unit/models/loader/test_quantized_checkpoints.py",),
        ("-k", "folder_brings"),
        why="--transformer-weights-path at a ModelOpt folder reads its FP8 weights as unquantized",
    ),
    _m(
        "quant-config-group-size-type-unchecked",
        "models/quantization_config.py",
        "if isinstance(group, bool) or not isinstance(group, int):",
        "if False:",
        ("test/unit/models/loader/test_quantized_checkpoints.py",),
        ("-k", "malformed"),
        why="a group_size of another type crashes with a bare error instead of naming the field",
    ),
    _m(
        "quant-scale-per-row-accepted",
        "layers/quantization/scales.py",
        "    if shape not in ((), (1,)):",
        "    if len(shape) > 2:",
        ("test/unit/layers/quantization/test_scales.py",),
        why="a per-row or [1, 1] scale loads where the checkpoint contract says per-tensor only",
    ),
    # ------------------------------------------------------------------ Ulysses, uneven heads
    _m(
        "ulysses-uneven-heads-reversed",
        "distributed/sequence.py",
        "inp = torch.cat([c.reshape(-1) for c in x.split(list(hs), 2)])",
        "inp = torch.cat([c.reshape(-1) for c in x.flip(2).split(list(hs), 2)])",
        ("test/unit/layers/test_attention.py",),
        ("-k", "uneven and ulysses4"),
        why="uneven Ulysses heads are sent from the wrong end (rank i attends another's heads)",
    ),
    _m(
        "ulysses-uneven-return-scrambled",
        "distributed/sequence.py",
        "return torch.cat([p.view(b, s, n, d) for p, n in zip(out.split(recv), hs)], 2)",
        "return torch.cat([p.view(b, n, s, d).transpose(1, 2) for p, n in zip(out.split(recv), "
        "hs)], 2)",
        ("test/unit/layers/test_attention.py",),
        ("-k", "uneven and ulysses4"),
        why="the returning uneven head chunks are re-shaped token-major (heads and tokens mixed)",
    ),
    # ---- per-request step caching (the cache field, its policy, its batch key, its counts)
    _m(
        "request-cache-field-ignored",
        "pipelines/base.py",
        "cfg = params.cache  # resolved",
        "cfg = self.step_cache  # resolved",
        ("test/integration/caching/test_request_cache.py",),
        ("-k", "skips_steps"),
        why="a request's cache is resolved and reported valid, but the server's default runs",
    ),
    _m(
        "request-cache-policy-not-enforced",
        "configs/sampling_params.py",
        "        if self.request_cache:\n            return\n",
        "        if True:\n            return\n",
        ("test/unit/configs/sampling_params/test_cache.py",),
        why="--cache-request-policy deny lets a request choose its step caching anyway",
    ),
    _m(
        "request-cache-batch-key-without-fn-bn",
        "configs/sampling_params.py",
        "return (value.fn, value.bn) if value.enabled else None",
        "return value.enabled",
        ("test/unit/configs/sampling_params/test_cache.py",),
        why="requests with different Fn/Bn share a DiT call, which the step cache refuses",
    ),
    _m(
        "request-cache-fn-bn-bound-off-by-one",
        "configs/sampling_params.py",
        "if fn + cfg.bn >= blocks:",
        "if fn + cfg.bn > blocks:",
        ("test/unit/configs/sampling_params/test_cache.py",),
        why="fn + bn equal to the block count is queued and fails in the DiT call (500, not 400)",
    ),
    _m(
        "request-cache-counts-not-answered",
        "entrypoints/images.py",
        "step_cache=counts.get(STEP_CACHE_INFO),",
        "step_cache=None,",
        ("test/integration/caching/test_request_cache.py",),
        ("-k", "skips_steps"),
        why="the image answer drops the request's step-cache counts",
    ),
    # ---- step caching of every family: flag-named passes, experts
    _m(
        "ltx2-guidance-flags-not-in-cache-key",
        "models/dits/ltx2.py",
        '"blocks", isolate_modalities=isolate_modalities, stg=tuple(sorted(stg_blocks))',
        '"blocks"',
        ("test/integration/caching/test_families_video.py",),
        ("-k", "guidance_passes"),
        why="LTX-2's STG pass reuses the conditional pass's state and skips: STG adds nothing",
    ),
    _m(
        "ltx2-isolation-not-in-cache-key",
        "models/dits/ltx2.py",
        '"blocks", isolate_modalities=isolate_modalities, stg=tuple(sorted(stg_blocks))',
        '"blocks", stg=tuple(sorted(stg_blocks))',
        ("test/integration/caching/test_families_video.py",),
        ("-k", "guidance_passes"),
        why="LTX-2's modality-isolation pass shares the conditional pass's cache state",
    ),
    _m(
        "step-cache-experts-share-states",
        "layers/step_cache/base.py",
        "state_key = (seq.name, id(seq.owner), row.context, comp)",
        "state_key = (seq.name, 0, row.context, comp)",
        ("test/integration/caching/test_families_wan.py",),
        ("-k", "a14b"),
        why="Wan2.2's low-noise expert compares with (and reuses) the high-noise expert's state",
    ),
    _m(
        "registry-listing-in-import-order",
        "models/registry.py",
        "    return sorted(_FAMILIES.values(), key=lambda f: f.name)",
        "    return list(_FAMILIES.values())",
        ("test/unit/models/test_registry.py",),
        ("-k", "import_order"),
        why="the CLI help and /v1/models list families in whatever order a program imported them",
    ),
    _m(
        "batch-invariant-short-inputs-unpadded",
        "layers/batch_invariant.py",
        "return rows, head if head >= minimum else 0",
        "return rows, rows",
        ("test/unit/layers/test_batch_invariant.py",),
        why="1-3-row conditioning GEMMs run unpadded: a request's image changes in a batch",
    ),
    # ------------------------------------------------------------------ step-cache limits
    _m(
        "step-cache-no-continuous-limit",
        "layers/step_cache/dbcache.py",
        "or _at_limit(st.continuous, cfg.max_continuous_cached_steps)",
        "or False",
        ("test/unit/layers/step_cache/test_dbcache.py",),
        ("-k", "step_limits"),
        why="--cache-max-continuous-cached-steps is ignored: a long run of skipped steps",
    ),
    _m(
        "step-cache-skips-not-counted",
        "layers/step_cache/dbcache.py",
        "                st.cached += 1\n",
        "",
        ("test/unit/layers/step_cache/test_dbcache.py",),
        ("-k", "step_limits"),
        why="--cache-max-cached-steps never reached: every step may be skipped",
    ),
    _m(
        "step-cache-dbcache-fn-not-scaled",
        "layers/step_cache/config.py",
        "return max(1, min(8, num_blocks // 4))",
        "return 8",
        ("test/unit/layers/step_cache/test_config.py",),
        why="the dbcache preset (F8) is refused on every model of 9 blocks or fewer",
    ),
    _m(
        "request-cache-method-type-said-missing",
        "configs/sampling_params.py",
        "        if method is None:\n",
        "        if not isinstance(method, str):\n",
        ("test/integration/caching/test_request_cache.py",),
        ("-k", "invalid"),
        why='{"method": 3} is answered "cache.method is required"',
    ),
    _m(
        "request-cache-wrong-json-type-said-string",
        "entrypoints/schema_errors.py",
        """    "cache": 'a method name""",
        """    "cache_": 'a method name""",
        ("test/integration/caching/test_request_cache.py",),
        ("-k", "422"),
        why='cache: 3 is answered "cache must be a string" (an object is fine too)',
    ),
    # ------------------------------------------------------------------ continuous batching
    _m(
        "continuous-join-only-when-drained",
        "pipelines/batching.py",
        "        if not ready:\n            return False\n",
        "        if True:\n            return False\n",
        ("test/unit/pipelines/test_batching.py",),
        why="a request arriving during a batch waits for all of it (request-level batching)",
    ),
    _m(
        "continuous-join-ignores-room",
        "entrypoints/scheduler.py",
        "while self._queue and len(taken) < self.max_batch_size - running:",
        "while self._queue and len(taken) < self.max_batch_size:",
        ("test/unit/entrypoints/test_scheduler.py",),
        why="joins grow a running loop past --max-batch-size",
    ),
    _m(
        "continuous-join-ignores-settings",
        "entrypoints/scheduler.py",
        'if t.kind != "generate" or _join_key(t) != key:',
        'if t.kind != "generate":',
        ("test/unit/entrypoints/test_scheduler.py",),
        why="a generation of another size joins (and overtakes) the running loop",
    ),
    _m(
        "continuous-lone-request-that-shares-no-loop",
        "entrypoints/scheduler.py",
        "and _shares_loops(live[0])",
        "and live[0] is not None",
        ("test/unit/entrypoints/test_scheduler.py",),
        why="an LTX-2 two-stage request runs in a loop its pipeline refuses (it fails)",
    ),
    _m(
        "continuous-joiner-without-its-adapters",
        "runtime/runner.py",
        "params, selection, cond = item, self._selections([item])[0], None",
        "params, selection, cond = item, None, None",
        ("test/integration/batching/test_continuous_batching.py",),
        ("-k", "every_order"),
        why="a request that joins a running loop runs without its own lora composition",
    ),
    # ------------------------------------------------------------------ compiled LoRA blocks
    _m(
        "lora-compiled-reads-the-mapping",
        "layers/lora/layer.py",
        "own = torch.where(rs.use_rows > 0, table.to(active.dtype), active[None]) * present",
        "own = (table.to(active.dtype) if self.lora_context.mapping is not None "
        "else active[None]) * present",
        ("test/unit/layers/lora/test_layer.py",),
        ("-k", "recompile"),
        why="the traced forward reads the Python row mapping: a compiled block recompiles "
        "whenever a request sets or drops one",
    ),
    _m(
        "lora-compiled-python-strength",
        "layers/lora/layer.py",
        "present, active, merged = self._lora_plan.unbind(0)",
        "present, active, merged = self._lora_plan.unbind(0)\n"
        "        active = active * (1.0 + 0.0 * sum(v for _, v in self._active_local))",
        ("test/unit/layers/lora/test_layer.py",),
        ("-k", "recompile"),
        why="a Python float strength leaks into the graph: every strength change recompiles",
    ),
    _m(
        "lora-compiled-offsets-minus-merged",
        "layers/lora/layer.py",
        "s.lora_offset, s.offset_scale, offset_coef)",
        "s.lora_offset, s.offset_scale, coef)",
        ("test/integration/compile/test_block_compile.py",),
        ("-k", "recompile and wan"),
        why="compiled rows on the merged composition lose their adapters' output offsets",
    ),
    _m(
        "lora-row-strengths-not-restored",
        "layers/lora/composition.py",
        "            self.row_strengths.set(previous)\n",
        "",
        ("test/unit/layers/lora/test_row_strengths.py", "test/unit/layers/lora/test_layer.py"),
        ("-k", "rows or recompile"),
        why="after a request's mapping the compiled blocks keep its rows for later calls",
    ),
    _m(
        "magcache-retention-rounds-down",
        "layers/step_cache/magcache.py",
        "if t < int(config.retention_ratio * steps + 0.5):",
        "if t < int(config.retention_ratio * steps):",
        ("test/unit/layers/step_cache/test_magcache.py",),
        why="diffusers rounds the retained steps to nearest: 0.25 x 10 steps retains 3, not 2",
    ),
    _m(
        "magcache-max-skip-exclusive",
        "layers/step_cache/magcache.py",
        "st.acc_steps <= config.max_skip_steps",
        "st.acc_steps < config.max_skip_steps",
        ("test/unit/layers/step_cache/test_magcache.py",),
        why="one skipped step fewer in a row than max_skip_steps allows",
    ),
    _m(
        "magcache-error-not-accumulated",
        "layers/step_cache/magcache.py",
        "st.acc_err = np.float32(st.acc_err + abs(np.float32(1.0) - st.acc_ratio))",
        "st.acc_err = np.float32(abs(np.float32(1.0) - st.acc_ratio))",
        ("test/unit/layers/step_cache/test_magcache.py",),
        why="only the last step's error is compared with the threshold: more steps are skipped",
    ),
    _m(
        "magcache-ratio-not-reset-on-compute",
        "layers/step_cache/magcache.py",
        "st.acc_ratio, st.acc_err, st.acc_steps = np.float32(1.0), np.float32(0.0), 0",
        "st.acc_err, st.acc_steps = np.float32(0.0), 0",
        ("test/unit/layers/step_cache/test_magcache.py",),
        why="the product of ratios keeps running across a computed step (diffusers resets it)",
    ),
    _m(
        "magcache-ratio-of-previous-step",
        "layers/step_cache/magcache.py",
        "scale = np.float32(st.ratios[t]) if t < len(st.ratios)",
        "scale = np.float32(st.ratios[t - 1]) if t < len(st.ratios)",
        ("test/unit/layers/step_cache/test_magcache.py",),
        why="each step accumulates the ratio of the step before it",
    ),
    _m(
        "magcache-calibration-ratio-of-means",
        "layers/step_cache/magcache.py",
        "ratio = (cur / (prev + 1e-8)).mean().item()",
        "ratio = (cur.mean() / (prev.mean() + 1e-8)).item()",
        ("test/unit/layers/step_cache/test_magcache.py",),
        why="the ratio of mean norms, not diffusers' mean of per-token norm ratios",
    ),
    _m(
        "magcache-interp-floor",
        "layers/step_cache/mag_ratios.py",
        "idx = torch.round(torch.arange(length, dtype=torch.float32) * scale)",
        "idx = torch.floor(torch.arange(length, dtype=torch.float32) * scale)",
        ("test/unit/layers/step_cache/test_mag_ratios.py",),
        why="the ratios resampled to the step count take the lower neighbour, not the nearest",
    ),
    _m(
        "magcache-skip-keeps-head-input",
        "layers/step_cache/magcache.py",
        "return (head[0] + g.state.residual, *head[1:])",
        "return head",
        ("test/integration/caching/test_magcache_parity.py",),
        ("-k", "flux_magcache"),
        why="a skipped step returns its input without the cached residual",
    ),
    # ------------------------------------------------------------------ step_cache/teacache.py
    _m(
        "teacache-accumulator-never-reset",
        "layers/step_cache/teacache.py",
        "g.state.accumulated = 0.0 if g.compute else acc",
        "g.state.accumulated = acc",
        ("test/unit/layers/step_cache/test_teacache.py",),
        why="the accumulated change keeps growing across computed steps (TeaCache resets it)",
    ),
    _m(
        "teacache-last-step-not-forced",
        "layers/step_cache/teacache.py",
        "last = g.cache.num_steps is not None and step == g.cache.num_steps - 1",
        "last = False",
        ("test/unit/layers/step_cache/test_teacache.py",),
        why="the last step may be skipped (the reference always computes it)",
    ),
    _m(
        "teacache-prev-only-first-step",
        "layers/step_cache/teacache.py",
        "            st.prev = cur\n",
        "            st.prev = cur if st.prev is None else st.prev\n",
        ("test/unit/layers/step_cache/test_teacache.py",),
        why="m_prev stays at the first step instead of following every step",
    ),
    _m(
        "teacache-no-rescale",
        "layers/step_cache/teacache.py",
        "acc = accumulated + rescaled(change, coefficients)",
        "acc = accumulated + change",
        ("test/unit/layers/step_cache/test_teacache.py",),
        why="the raw change accumulates, not the family's rescaled estimate",
    ),
    _m(
        "teacache-skip-without-residual",
        "layers/step_cache/teacache.py",
        "return tuple(h + r for h, r in zip(head, g.state.residuals))",
        "return head",
        ("test/unit/layers/step_cache/test_teacache.py",),
        why="a skipped step returns its input without the cached residual",
    ),
    _m(
        "teacache-flux-unmodulated-input",
        "models/dits/flux.py",
        'lambda s, a: first.norm1(s[0], a["temb"])[0],',
        "lambda s, a: s[0],",
        ("test/integration/caching/test_teacache_parity.py",),
        ("-k", "modulated_input_is_block0"),
        why="Flux compares the raw image stream, not block 0's modulated norm (TeaCache4FLUX)",
    ),
    _m(
        "step-cache-sp-shards-not-summed",
        "layers/step_cache/base.py",
        "        _all_reduce(stats, get_sp_group())\n",
        "        pass\n",
        ("test/unit/layers/step_cache/test_base.py",),
        ("-k", "sequence_parallel"),
        why="under sequence parallelism each rank decides on its own shard's statistic",
    ),
    _m(
        "teacache-shards-not-summed",
        "layers/step_cache/teacache.py",
        "        sum_over_shards(stats, rows)\n",
        "",
        ("test/unit/layers/step_cache/test_base.py",),
        ("-k", "sequence_parallel"),
        why="TeaCache's change is measured on each sequence-parallel shard alone",
    ),
    _m(
        "dbcache-shards-not-summed",
        "layers/step_cache/dbcache.py",
        "        sum_over_shards(stats, rows)\n",
        "",
        ("test/unit/layers/step_cache/test_base.py",),
        ("-k", "sequence_parallel"),
        why="FBCache's / DBCache's head-residual change is measured on each shard alone",
    ),
    _m(
        "continuous-with-experts-offloaded-one-at-a-time",
        "runtime/engine.py",
        'return not self._executor.info.get("per_expert_offload", False)',
        "return True",
        ("test/unit/runtime/test_engine.py",),
        why="Wan2.2 A14B with --dit-cpu-offload runs requests of different step counts in one "
        "loop: one request moving its expert in parks the expert another still calls",
    ),
    _m(
        "compile-blocks-keeps-recompile-limit",
        "runtime/placement.py",
        "dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)",
        "dynamo.recompile_limit = dynamo.recompile_limit",
        ("test/unit/runtime/test_placement.py",),
        why="a server's ninth graph of a block class (shapes x LoRA x batch 1) fails the request "
        "under fullgraph=True",
    ),
    _m(
        "request-cache-no-step-limit-becomes-the-presets",
        "configs/sampling_params.py",
        "knobs[k] = -1",
        "pass",
        ("test/unit/configs/sampling_params/test_cache.py",),
        why="--cache-max-continuous-cached-steps -1 (no limit) is resolved back to the fbcache / "
        "dbcache preset's 4 for every request",
    ),
    _m(
        "step-cache-preset-not-in-the-docstring-table",
        "layers/step_cache/config.py",
        '"magcache": dict(threshold=0.2, fn=0',
        '"magcache": dict(threshold=0.06, fn=0',
        ("test/unit/layers/step_cache/test_config.py",),
        why="a preset changes and the module docstring's table still states the old value",
    ),
    _m(
        "models-cache-no-limit-as-null",
        "layers/step_cache/config.py",
        'value = -1  # cache-dit\'s "no limit"',
        "pass",
        ("test/unit/configs/sampling_params/test_cache.py",),
        why="/v1/models reports no step limit as null, which a request reads as the preset's 4",
    ),
    _m(
        "models-cache-reports-other-methods-knobs",
        "layers/step_cache/config.py",
        "if self.method not in _FLAGS[f.name][2]:  # another method's knob\n                continue",
        "pass",
        ("test/unit/configs/sampling_params/test_cache.py",),
        why="/v1/models' cache carries knobs of other methods, refused when sent back",
    ),
    _m(
        "cache-float-knob-takes-nan",
        "layers/step_cache/config.py",
        "not isinstance(value, Real) or not isfinite(value):",
        "not isinstance(value, Real):",
        (
            "test/unit/layers/step_cache/test_config.py",
            "test/unit/configs/server_args/test_cache_flags.py",
        ),
        why="--cache-threshold nan is accepted (sglang generate then names cache.threshold)",
    ),
    _m(
        "cache-int-knob-takes-a-bool",
        "layers/step_cache/config.py",
        "if isinstance(value, bool) or not isinstance(value, Integral):",
        "if not isinstance(value, Integral):",
        ("test/unit/layers/step_cache/test_config.py",),
        why="StepCacheConfig.of(..., fn=True) is taken as Fn 1",
    ),
    _m(
        "mag-ratios-steps-takes-a-bool",
        "layers/step_cache/mag_ratios.py",
        "if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:",
        "if not isinstance(steps, int) or steps < 1:",
        ("test/unit/layers/step_cache/test_mag_ratios.py",),
        why='a ratios file with "num_inference_steps": true is read as calibrated for 1 step',
    ),
    _m(
        "mag-ratios-file-of-a-list",
        "layers/step_cache/mag_ratios.py",
        "if not isinstance(data, dict):",
        "if data is None:",
        ("test/unit/layers/step_cache/test_mag_ratios.py",),
        why="a ratios file holding a JSON list fails with a TypeError naming neither file nor field",
    ),
    _m(
        "calibrate-cache-writes-into-the-package",
        "../cli/calibrate_cache.py",
        "if args.model_path is None and args.output is None:",
        "if False:",
        ("test/unit/cli/test_calibrate_cache.py",),
        why="sglang calibrate-cache without --model-path overwrites the demo model's ratios file "
        "inside the installed package",
    ),
    _m(
        "health-generation-left-without-the-lock",
        "entrypoints/scheduler_health.py",
        "with self._lock:\n            self._running_gens.pop(id(generation), None)",
        "if True:\n            self._running_gens.pop(id(generation), None)",
        ("test/unit/entrypoints/test_scheduler_health.py",),
        why="the engine's compute thread updates the monitor in the middle of the scheduler's "
        "event: a finished generation is still counted as running",
    ),
    _m(
        "cache-num-steps-ignores-strength",
        "pipelines/base.py",
        "g.cache.num_steps = len(timesteps)",
        "pass",
        ("test/integration/caching/test_cache_image_to_image.py",),
        why="image-to-image at strength 0.5: TeaCache waits for step n - 1, which never runs, "
        "so the last step run is skipped",
    ),
    # ------------------------------------------------------------------ CPU GEMM backend
    _m(
        "cpu-gemm-onednn-single-row-unpadded",
        "layers/cpu_gemm.py",
        'ROW_RULES = {"onednn": (1, 2), "onednn-packed": (1, 2), "blas": (4, 4)}',
        'ROW_RULES = {"onednn": (1, 1), "onednn-packed": (1, 1), "blas": (4, 4)}',
        ("test/unit/layers/test_batch_invariant.py",),
        why="oneDNN's 1-row GEMV rounds differently: a request's conditioning changes in a batch",
    ),
    _m(
        "cpu-gemm-packed-ignores-in-place-writes",
        "layers/cpu_gemm.py",
        "key = (weight.data_ptr(), weight._version)",
        "key = (weight.data_ptr(), 0)",
        ("test/unit/layers/test_cpu_gemm.py",),
        ("-k", "packed_copy"),
        why="a LoRA merged in place runs on the stale packed copy of the old weight",
    ),
    _m(
        "cpu-gemm-load-keeps-packed-copy",
        "layers/quantization/base.py",
        "        self.packed.clear()\n        layer.load_output_rows(",
        "        layer.load_output_rows(",
        ("test/unit/layers/test_cpu_gemm.py",),
        ("-k", "packed_copy"),
        why="reloaded weights (written through .data) keep running on the old packed copy",
    ),
    _m(
        "cpu-gemm-lora-swap-not-told",
        "layers/lora/layer.py",
        "            self.base_layer.weight_changed()  # no version counter moved\n",
        "",
        ("test/unit/layers/test_cpu_gemm.py",),
        ("-k", "lora_merges"),
        why="a LoRA merge swaps its weight in through .data: a packed copy of the previous weight "
        "at a reused address would serve the new composition",
    ),
    _m(
        "cpu-gemm-weight-changed-keeps-copy",
        "layers/quantization/base.py",
        "    def weight_changed(self, layer):\n        self.packed.clear()",
        "    def weight_changed(self, layer):\n        pass",
        ("test/unit/layers/test_cpu_gemm.py",),
        ("-k", "old_address"),
        why="a weight swapped in at the old address runs on the old packed copy",
    ),
    _m(
        "cpu-gemm-onednn-under-autograd",
        "layers/cpu_gemm.py",
        "        and not (\n            torch.is_grad_enabled()",
        "        and (\n            torch.is_grad_enabled()",
        ("test/unit/layers/test_cpu_gemm.py",),
        ("-k", "record_gradients or exact_fp32"),
        why="GEMMs that need gradients go to an operator without autograd",
    ),
    # ------------------------------------------------------------------ continuous batching, TP
    _m(
        "continuous-tp-admit-at-rank0-only-boundaries",
        "pipelines/batching.py",
        "        return self.shared is None or any(",
        "        return True or any(",
        ("test/integration/batching/test_continuous_batching_tp.py",),
        why="ranks ask for joins at different boundaries (rank 0's encode/decode steps): they "
        "admit at different steps and the collectives diverge",
    ),
    _m(
        "continuous-tp-joiner-encodes-inside-the-loop",
        "runtime/runner.py",
        "conditioning=conds.pop(i, None),",
        "conditioning=None,",
        ("test/integration/batching/test_continuous_batching_tp.py",),
        why="rank 0 encodes a joining prompt in a step shared with the others' DiT collectives, "
        "which the other ranks cannot run before the prompt's broadcast",
    ),
    _m(
        "continuous-tp-joiner-error-retyped",
        "pipelines/base.py",
        "            if cond.error is not None:  # rank 0",
        "            if False:  # rank 0",
        ("test/integration/batching/test_continuous_batching_tp.py",),
        ("-k", "fail_alone"),
        why="a joiner whose prompt the encoder rejects gets a RuntimeError (HTTP 500) instead of "
        "the encoder's own error, as it would alone",
    ),
    _m(
        "continuous-tp-rank0-calls-split-groups",
        "pipelines/batching.py",
        "            calls.sort(key=lambda c: id(c.denoiser) not in self.shared)\n",
        "",
        ("test/integration/batching/test_continuous_batching_tp.py",),
        ("-k", "cannot_be_resolved"),
        why="rank 0's decode of a finished request splits the others' DiT group on rank 0 alone: "
        "the ranks run collectives of different sizes (gloo aborts)",
    ),
    _m(
        "continuous-late-answer-unanswered",
        "runtime/engine.py",
        "            if i not in answered:\n",
        "            if False:\n",
        ("test/integration/batching/test_continuous_batching_tp.py",),
        ("-k", "too_late"),
        why="a request admitted after its loop ended is never answered (its client waits forever)",
    ),
    _m(
        "continuous-unresolvable-joiner-shifts-numbers",
        "runtime/engine.py",
        "                try:  # any failure is this request's alone (the others keep their numbers)\n"
        "                    ready.append(self._resolve(r, {}))\n"
        "                except Exception as e:",
        "                try:  # any failure is this request's alone (the others keep their numbers)\n"
        "                    ready.append(self._resolve(r, {}))\n"
        "                except errors_mod.SGLangError as e:",
        ("test/integration/batching/test_continuous_batching_tp.py",),
        ("-k", "cannot_be_resolved"),
        why="a joiner that cannot be resolved leaves its number taken: the next joiner's image goes "
        "to another request",
    ),
    _m(
        "continuous-tp-each-rank-selects",
        "runtime/worker.py",
        "items.append((params, sel, cond))",
        "items.append(params)",
        ("test/integration/batching/test_continuous_batching_tp.py",),
        why="every rank selects a joining request's adapters itself (rank 0 must, and send them)",
    ),
]


@dataclass
class Result:
    name: str
    status: str  # caught | survived | stale | ambiguous | timeout | error
    seconds: float = 0.0
    file: str = ""
    detail: str = ""
    tests: list[str] = field(default_factory=list)


def _locate(m: Mutant, root: str) -> tuple[str | None, str]:
    """``(file, status)``: the first candidate file holding the snippet, and ``"ok"``,
    ``"stale"`` or ``"ambiguous"``."""
    for f in m.files:
        path = os.path.join(root, f)
        if not os.path.isfile(path):
            continue
        n = open(path, encoding="utf-8").read().count(m.old)
        if n == 1:
            return f, "ok"
        if n > 1:
            return f, "ambiguous"
    return None, "stale"


def _copy_tree(dst: str) -> None:
    for item in COPY_ITEMS:
        src = os.path.join(ROOT, item)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(dst, item), ignore=IGNORE)
        elif os.path.isfile(src):
            shutil.copy2(src, os.path.join(dst, item))


def _env(copy: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(copy, "python")] + [p for p in [env.get("PYTHONPATH")] if p]
    )
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _run(cmd: list[str], cwd: str, timeout: float) -> tuple[int | None, str]:
    """Run ``cmd`` in its own process group; on timeout the whole group is killed."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=_env(cwd),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out


def _pytest(tests, args) -> list[str]:
    return [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args, *tests]


def check_isolation(tmp: str) -> str:
    """Make sure a copy imports its own ``sglang`` (not the editable install of the tree)."""
    copy = tempfile.mkdtemp(prefix="isolation-", dir=tmp)
    _copy_tree(copy)
    code = "import sglang.multimodal_gen as m; print(m.__file__)"
    rc, out = _run([sys.executable, "-c", code], copy, 120)
    where = out.strip().splitlines()[-1] if out.strip() else ""
    shutil.rmtree(copy, ignore_errors=True)
    if rc != 0 or not where.startswith(copy):
        raise SystemExit(f"mutants: the copy imports sglang from {where!r}, not from {copy}")
    return where


def run_mutant(m: Mutant, tmp: str, timeout: float, keep: bool) -> Result:
    file, status = _locate(m, ROOT)
    res = Result(m.name, status, file=file or m.files[0], tests=list(m.tests))
    if status != "ok":
        res.detail = f"snippet not found in {', '.join(m.files)}" if status == "stale" else ""
        return res
    copy = tempfile.mkdtemp(prefix=f"{m.name}-", dir=tmp)
    try:
        _copy_tree(copy)
        path = os.path.join(copy, file)
        src = open(path, encoding="utf-8").read()
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(src.replace(m.old, m.new, 1))
        t0 = time.perf_counter()
        rc, out = _run(_pytest(m.tests, m.args), copy, timeout)
        res.seconds = time.perf_counter() - t0
        tail = [ln for ln in out.strip().splitlines() if ln.strip()]
        res.detail = tail[-1] if tail else ""
        if rc is None:
            res.status = "timeout"
        elif rc == 0:
            res.status = "survived"
        elif rc == 1:
            res.status = "caught"
        else:  # 2: interrupted / collection error, 3: internal, 4: usage, 5: nothing collected
            res.status = "caught" if rc == 2 else "error"
            res.detail = f"pytest exit {rc}: {res.detail}"
    finally:
        if not keep:
            shutil.rmtree(copy, ignore_errors=True)
    return res


def run_baseline(mutants: list[Mutant], tmp: str, timeout: float) -> tuple[bool, float, str]:
    """The selected mutants' tests on an unmutated copy (each test file with its own args)."""
    copy = tempfile.mkdtemp(prefix="baseline-", dir=tmp)
    _copy_tree(copy)
    groups: dict[tuple[str, ...], list[str]] = {}
    for m in mutants:
        if _locate(m, ROOT)[1] == "ok":
            files = groups.setdefault(m.args, [])
            files.extend(t for t in m.tests if t not in files)
    t0 = time.perf_counter()
    try:
        for args, tests in groups.items():
            rc, out = _run(_pytest(tests, args), copy, timeout * max(1, len(tests)))
            if rc != 0:
                tail = "\n".join(out.strip().splitlines()[-15:])
                return False, time.perf_counter() - t0, f"{' '.join(args)} {tests}:\n{tail}"
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    return True, time.perf_counter() - t0, ""


def table(results: list[Result]) -> str:
    lines = ["| mutant | file | result | seconds |", "|---|---|---|---:|"]
    for r in results:
        f = r.file.removeprefix(PKG)
        secs = f"{r.seconds:.1f}" if r.seconds else "-"
        lines.append(f"| {r.name} | {f} | {r.status} | {secs} |")
    return "\n".join(lines) + "\n\n" + summary_line(results) + "\n"


def summary_line(results: list[Result]) -> str:
    """``N mutations, C caught, S survived, T stale`` (then any other outcome, and the names of
    the mutants that were not caught)."""
    count = {k: sum(r.status == k for r in results) for k in ("caught", "survived", "stale")}
    caught = count["caught"] + sum(r.status == "timeout" for r in results)
    line = (
        f"{len(results)} mutations, {caught} caught, {count['survived']} survived, "
        f"{count['stale']} stale"
    )
    other = [r for r in results if r.status not in ("caught", "timeout", "survived", "stale")]
    if other:
        line += ", " + ", ".join(f"{r.name} {r.status}" for r in other)
    missed = [r.name for r in results if r.status not in ("caught", "timeout")]
    return line + (f" (not caught: {', '.join(missed)})" if missed else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--only", action="append", default=[], help="run only NAME (repeatable)")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run in parallel (default 1)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per mutant's tests")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    ap.add_argument("--keep", action="store_true", help="keep the mutated copies")
    ap.add_argument("--report", help="also write the markdown table to this file")
    ap.add_argument("--json", help="also write the results as JSON to this file")
    a = ap.parse_args(argv)

    names = {n for item in a.only for n in item.split(",") if n}
    unknown = names - {m.name for m in MUTANTS}
    if unknown:
        ap.error(f"unknown mutant(s): {sorted(unknown)}; see --list")
    selected = [m for m in MUTANTS if not names or m.name in names]

    if a.list:
        stale = []
        for m in selected:
            file, status = _locate(m, ROOT)
            if status != "ok":
                stale.append(m.name)
            where = (file or " | ".join(m.files)).removeprefix(PKG)
            tests = " ".join(t.removeprefix("test/") for t in m.tests)
            extra = f" {' '.join(m.args)}" if m.args else ""
            print(f"{m.name:36s} {status:9s} {where:32s} {tests}{extra}")
            if m.why:
                print(f"{'':36s} {m.why}")
        if stale:
            print(f"stale or ambiguous (update their snippets): {', '.join(stale)}")
        return 1 if stale else 0

    tmp = tempfile.mkdtemp(prefix="sglang-mutants-")
    try:
        where = check_isolation(tmp)
        print(f"copies import sglang from the copy ({where})", flush=True)
        if not a.no_baseline:
            ok, secs, detail = run_baseline(selected, tmp, a.timeout)
            print(f"baseline (unmutated): {'pass' if ok else 'FAIL'} in {secs:.1f} s", flush=True)
            if not ok:
                print(detail)
                return 2
        results: list[Result] = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
            futures = {pool.submit(run_mutant, m, tmp, a.timeout, a.keep): m for m in selected}
            for fut in concurrent.futures.as_completed(futures):
                r = fut.result()
                results.append(r)
                print(f"{r.name:36s} {r.status:9s} {r.seconds:6.1f} s  {r.detail}", flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    order = {m.name: i for i, m in enumerate(MUTANTS)}
    results.sort(key=lambda r: order[r.name])
    text = table(results)
    print()
    print(text.rsplit("\n\n", 1)[0])
    print()
    print(summary_line(results))  # the last line
    if a.report:
        with open(a.report, "w", encoding="utf-8") as fh:
            fh.write(text)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump([r.__dict__ for r in results], fh, indent=1)
    bad = [r for r in results if r.status not in ("caught", "timeout")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
