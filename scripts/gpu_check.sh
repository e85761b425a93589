#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md in one command, sized for one H200 and a 10-minute
# limit: the LoRA linear overhead at Z-Image-Turbo widths, then Z-Image-Turbo end to end against
# diffusers (real shapes, random weights, bf16, 1024x1024, 8 steps) eager, LTX-2.3 end to end
# against diffusers (the real 48-layer DiT shapes, bf16, 512x768, 25 frames, 4 steps, CFG + STG +
# modality isolation), HunyuanVideo 1.0 end to end against diffusers (the real 20 + 40 block DiT
# shapes, bf16), then Z-Image-Turbo with torch.compile and with each SDPA kernel, and last the
# quantized linear layers at FLUX.1 widths (hidden 3072, MLP 12288, 4096 + 512 tokens, bf16):
# FP8 through torch._scaled_mm (row-wise scales, sm >= 89) and NVFP4 weight-only against bf16
# F.linear, with the FP8 result checked against an emulation of its operands and against the
# dequantized bf16 GEMM (benchmarks/bench_quantized.py --gemm; exit 1 on a failed check). Each
# part has its own time limit, so one slow part cannot eat the rest.
#
#   bash scripts/gpu_check.sh                    # every part, in this order (at most 1020 s: over
#                                                # one 600-s device command, run it in two calls)
#   bash scripts/gpu_check.sh lora e2e           # only the parts named
#   GPU_CHECK_DRY=1 bash scripts/gpu_check.sh    # rehearsal on the CPU with the small configs
#   bash scripts/gpu_check.sh fetch-wheels       # here, not on the GPU machine: see below
#
# Parts: env, lora, e2e, ltx2, hunyuan, compile, flash, cudnn, quant. Logs go to $OUT/<part>.log
# (or ./gpu_check/).
#
# A GPU machine that lacks packages (diffusers, for one) installs them from wheels in .whl/ when
# that folder exists: `bash scripts/gpu_check.sh fetch-wheels` downloads them on a machine with
# internet access (for CPython 3.12 on x86-64 Linux; PY_VERSION overrides; huggingface-hub 2.x
# also needs httpx2, httpcore2 and truststore), and the folder travels with the repository to the
# GPU machine.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ "${1:-}" = "fetch-wheels" ]; then
  mkdir -p .whl
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version "${PY_VERSION:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "diffusers==0.42.1" "peft==0.21.2" "transformers==5.24.0" \
    "huggingface-hub==2.4.0" "tokenizers==0.23.3" "httpx2==2.16.2" \
    "httpcore2==2.16.2" "truststore==0.10.5"
  exit $?
fi

LOG=${OUT:-$PWD/gpu_check}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1
SITE=""
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu_check_site .whl/*.whl || exit 1
  SITE=/tmp/gpu_check_site:
fi
export PYTHONPATH="${SITE}$PWD/python${PYTHONPATH:+:$PYTHONPATH}"

if [ -n "${GPU_CHECK_DRY:-}" ]; then
  E2E=(--repeats 1 --steps 2)
  LORA=(--quick)
  BACKENDS=(flash math)
  QUANT=(--gemm --small --iters 2)
else
  E2E=(--gpu --repeats 3)
  LORA=(--device cuda --tokens 1024 4096 --ranks 16 64 128 --adapters 1 4)
  BACKENDS=(flash cudnn)
  QUANT=(--gemm --device cuda)
fi

# part NAME LIMIT_S COMMAND...: run it under a time limit, log to $LOG/NAME.log, report its status
FAILED=()
part() {
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$LOG/$name.log" 2>&1
  local rc=$?
  tail -n 12 "$LOG/$name.log"
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || FAILED+=("$name")
}

want() { [ $# -eq 0 ] || [[ " $* " == *" $PART "* ]]; }
for PART in env lora e2e ltx2 hunyuan compile "${BACKENDS[@]}" quant; do
  want "$@" || continue
  case $PART in
    env)
      part env 30 "$PY" -c "import torch, diffusers, transformers, peft, sglang
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())
print([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
print('diffusers', diffusers.__version__, 'transformers', transformers.__version__,
      'peft', peft.__version__, 'sglang', sglang.__file__)" ;;
    lora) part lora 80 "$PY" benchmarks/bench_lora_linear.py "${LORA[@]}" ;;
    e2e) part e2e 110 "$PY" benchmarks/bench_e2e.py "${E2E[@]}" ;;
    ltx2) part ltx2 170 "$PY" benchmarks/bench_e2e.py --family ltx2 "${E2E[@]}" ;;
    hunyuan) part hunyuan 170 "$PY" benchmarks/bench_e2e.py --family hunyuan-video "${E2E[@]}" ;;
    compile) part compile 140 "$PY" benchmarks/bench_e2e.py "${E2E[@]}" --compile ;;
    quant) part quant 150 "$PY" benchmarks/bench_quantized.py "${QUANT[@]}" ;;
    *) part "$PART" 85 "$PY" benchmarks/bench_e2e.py "${E2E[@]}" --attention-backend "$PART" ;;
  esac
done
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "== failed or timed out: ${FAILED[*]}"
  exit 1
fi
