#!/usr/bin/env bash
# The GPU check: GPU tests, then nano-vllm and its peer (HF transformers) side by side on the
# Qwen3-0.6B shape (random weights, built here offline). Everything goes to $OUT:
#
#   gpu_check.log        the whole run (this script's stdout and stderr)
#   env.json             python / torch / triton / transformers versions, the GPU
#   pytest.txt, pytest.xml   tests/gpu and tests/kernels on CUDA (the CPU path's greedy tokens equal
#                        the GPU's on tiny fp32 models; overlapped steps equal synchronous ones and
#                        launch without a CUDA sync, with stops, preemption, aborts and failed rows
#                        (tests/engine/test_overlap.py); the kernels match torch at real sizes)
#   offline.json         nano-vllm's published workload: 256 requests, input and output lengths
#                        uniform in 100-1024, ignore_eos (greedy here; nano-vllm samples at T=0.6)
#   decode_latency.json  decode step time at batch 1..128: CUDA graphs overlapped (the default),
#                        graphs with the host waiting every step (graph-sync), and eager
#   hf_peer.json         HF transformers on the same weights and dtype: batch-1 decode with a
#                        static cache under torch.compile, and plain `generate` throughput
#   greedy_check.json    nano-vllm's greedy tokens against HF's (bf16, 32 tokens, 8 prompts)
#   timeline.tar.gz      kernel-level timelines (torch.profiler) of graphed decode steps at batch 1
#                        and 64: fused Triton ops overlapped and synchronous (fused.*), torch ops
#                        (torch.*, NANOVLLM_TRITON_FUSED=0): kernels per step and per layer, GPU
#                        time, busy time, wall time
#   summary.json         every headline figure and goal, and each step's exit status
#                        (bench/gpu_summary.py says what each field is)
#
# Needs: Python with torch (CUDA), triton, transformers, safetensors, msgpack, xxhash, pytest.
# Installs nothing and reaches no network; does not need gguf (no GGUF default model is used).
# Budget: 450 s for the steps (GPU_CHECK_BUDGET_S), so with the summary and the machine's start
# it stays under 8 minutes: each step has its own timeout, cut to what is left of the budget (a
# step with under 15 s left is skipped, status 124); steps run even if an earlier one failed, and
# the exit status is non-zero if any failed. Estimated on an H100 (not yet measured): tests ~90 s,
# checkpoint ~30 s, offline ~35 s, decode latency and timelines ~90 s, torch-ops timeline ~30 s,
# the peer ~120 s (about half of it torch.compile), greedy check ~30 s.
#
#   OUT=/some/dir scripts/gpu_check.sh
#   GPU_CHECK_SMOKE=1 OUT=/some/dir scripts/gpu_check.sh   # on CPU: every step that runs there, on
#                        the tiny shape with small sizes, to check the plumbing and summary.json
set -u -o pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:?set OUT to the folder for results}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD:$PWD/client${PYTHONPATH:+:$PYTHONPATH}"  # the client package: the engine reads its wire limits
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET  # real kernels, never the interpreter
WORK="$(mktemp -d "${TMPDIR:-/tmp}/nanovllm-gpu-check.XXXXXX")"
export NANOVLLM_CACHE_DIR="$WORK/cache"
MODELS="$WORK/models"
if [ "${GPU_CHECK_SMOKE:-0}" = 1 ]; then  # CPU: tiny sizes; the tests are the suite's, not run here
  SHAPE=tiny DEVICE=cpu MODES=eager BATCHES=1,4 TL_BATCHES=1,4 TL_STEPS=4 PROMPT=16 OUTPUT=16 DTYPE=float32
  OFFLINE_ARGS=(--num-seqs 8 --min-input 8 --max-input 32 --min-output 4 --max-output 16 --max-model-len 256
                --max-num-seqs 8 --max-num-batched-tokens 256 --dtype float32 --device cpu)
  PEER_ARGS=(--device cpu --dtype float32 --no-compile --decode-steps 8 --prompt-len 16 --num-seqs 8
             --min-input 8 --max-input 32 --min-output 4 --max-output 16 --batch-size 4)
  GREEDY_ARGS=(--device cpu --dtype float32 --num-prompts 3 --max-prompt-len 40 --tokens 8)
else
  SHAPE=qwen3-0.6b DEVICE=cuda MODES=graph,graph-sync,eager BATCHES=1,8,32,64,128 TL_BATCHES=1,64 TL_STEPS=50
  PROMPT=128 OUTPUT=128 DTYPE=auto
  OFFLINE_ARGS=(--num-seqs 256 --min-input 100 --max-input 1024 --min-output 100 --max-output 1024
                --max-model-len 4096 --max-num-seqs 256 --max-num-batched-tokens 16384)
  PEER_ARGS=(--device cuda)
  GREEDY_ARGS=(--device cuda)
fi

BUDGET_S="${GPU_CHECK_BUDGET_S:-450}"  # the whole check: every step's timeout is cut to what is left

step() {  # step NAME TIMEOUT_S COMMAND...: run, time, record the exit status (124: out of time)
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt 15 ]; then
    echo "=== $name: skipped, ${left}s of the ${BUDGET_S}s budget left"
    STATUS[$name]=124
    return 124
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (timeout ${limit}s): $*"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  STATUS[$name]=$rc
  echo "=== $name: exit $rc after $((SECONDS - start))s"
  return $rc
}

json_line() {  # the benchmark's JSON result line from its output
  grep '^{"bench"' "$1" | tail -n 1
}

main() {
declare -A STATUS
step env 60 "$PYTHON" - "$OUT/env.json" <<'EOF'
import json, os, platform, sys
import torch, transformers
try:
    import triton
    triton_version = triton.__version__
except Exception as e:  # noqa: BLE001 - report, do not fail here
    triton_version = f"unavailable: {e}"
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": triton_version, "transformers": transformers.__version__,
        "cuda_available": torch.cuda.is_available(), "gpus": torch.cuda.device_count()}
if torch.cuda.is_available():
    free, total = torch.cuda.mem_get_info()
    info.update(gpu=torch.cuda.get_device_name(), gpu_total_gib=round(total / 2**30, 1),
                gpu_free_gib=round(free / 2**30, 1))
try:  # the card's name as nvidia-smi gives it (an H100 and an H200 differ)
    import subprocess
    info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                         "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
except (OSError, subprocess.SubprocessError):
    info["nvidia_smi"] = None
print(json.dumps(info))
json.dump(info, open(sys.argv[1], "w"), indent=1)
sys.exit(0 if torch.cuda.is_available() or os.environ.get("GPU_CHECK_SMOKE") == "1" else 1)
EOF

if [ "${GPU_CHECK_SMOKE:-0}" != 1 ]; then
  step tests 200 "$PYTHON" -m pytest -q -p no:cacheprovider --durations=15 --junitxml="$OUT/pytest.xml" \
    tests/gpu tests/kernels tests/engine/test_overlap.py 2>&1 | tee "$OUT/pytest.txt"
  STATUS[tests]=${PIPESTATUS[0]}
fi

# Build the random-weight checkpoint once (every benchmark below reuses it).
step model 90 "$PYTHON" -c "from bench.models import make_bench_model; print(make_bench_model('$SHAPE', '$MODELS'))"

step offline 150 "$PYTHON" -m bench.offline --shape "$SHAPE" --model-dir "$MODELS" --skip-hf "${OFFLINE_ARGS[@]}" \
  | tee "$WORK/offline.out"
STATUS[offline]=${PIPESTATUS[0]}
json_line "$WORK/offline.out" > "$OUT/offline.json"

# Decode steps, and the timelines of graphed ones: overlapped and synchronous, fused Triton ops.
mkdir -p "$WORK/timeline"
step decode_latency 200 "$PYTHON" -m bench.decode_latency --shape "$SHAPE" --model-dir "$MODELS" --device "$DEVICE" \
  --dtype "$DTYPE" --modes "$MODES" --batch-sizes "$BATCHES" --prompt-len "$PROMPT" --output-len "$OUTPUT" \
  --timeline "$WORK/timeline/fused" --timeline-batch-sizes "$TL_BATCHES" --timeline-steps "$TL_STEPS" \
  | tee "$WORK/decode.out"
STATUS[decode_latency]=${PIPESTATUS[0]}
json_line "$WORK/decode.out" > "$OUT/decode_latency.json"

# The same graphed steps with torch's ops instead of the fused Triton ones: what fusing saves.
NANOVLLM_TRITON_FUSED=0 step timeline_torch_ops 120 "$PYTHON" -m bench.decode_latency --shape "$SHAPE" \
  --model-dir "$MODELS" --device "$DEVICE" --dtype "$DTYPE" --modes "${MODES%%,*}" --batch-sizes "$TL_BATCHES" \
  --prompt-len "$PROMPT" --output-len "$OUTPUT" --timeline "$WORK/timeline/torch" --timeline-steps "$TL_STEPS" \
  | tee "$WORK/timeline/torch.out"
STATUS[timeline_torch_ops]=${PIPESTATUS[0]}
tar -czf "$OUT/timeline.tar.gz" -C "$WORK" timeline

# The peer on the same weights and dtype, each part in a fresh process.
step hf_peer 200 "$PYTHON" -m bench.hf_peer --shape "$SHAPE" --model-dir "$MODELS" "${PEER_ARGS[@]}" \
  | tee "$WORK/hf_peer.out"
STATUS[hf_peer]=${PIPESTATUS[0]}
json_line "$WORK/hf_peer.out" > "$OUT/hf_peer.json"

step greedy_check 120 "$PYTHON" -m bench.greedy_check --shape "$SHAPE" --model-dir "$MODELS" "${GREEDY_ARGS[@]}" \
  | tee "$WORK/greedy.out"
STATUS[greedy_check]=${PIPESTATUS[0]}
json_line "$WORK/greedy.out" > "$OUT/greedy_check.json"

STATUS_JSON="{"
for name in "${!STATUS[@]}"; do STATUS_JSON+="\"$name\": ${STATUS[$name]}, "; done
STATUS_JSON="${STATUS_JSON%, }}"
"$PYTHON" -m bench.gpu_summary "$OUT" "$WORK/timeline" --status "$STATUS_JSON" --elapsed "$SECONDS"

rm -rf "$WORK"
for rc in "${STATUS[@]}"; do [ "$rc" -eq 0 ] || return 1; done
}

main 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
