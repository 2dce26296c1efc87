#!/usr/bin/env bash
# The GPU check: GPU tests, then the offline benchmark and the decode-latency benchmark on the
# Qwen3-0.6B shape (random weights, built here offline). Everything goes to $OUT:
#
#   gpu_check.log        the whole run (this script's stdout and stderr)
#   env.json             python / torch / triton / transformers versions, the GPU
#   pytest.txt, pytest.xml   tests/gpu and tests/kernels on CUDA
#   offline.json         nano-vllm's published workload: 256 requests, input and output lengths
#                        uniform in 100-1024, ignore_eos (greedy here; nano-vllm samples at T=0.6)
#   decode_latency.json  batch-1 inter-token latency and decode step time, CUDA graphs vs eager
#   timeline.tar.gz      kernel-level timelines (torch.profiler) of graphed decode steps at batch 1
#                        and 64, with the fused Triton ops (fused.*) and without (torch.*,
#                        NANOVLLM_TRITON_FUSED=0): per step kernels, GPU time, busy time, wall time
#   summary.json         each step's exit status and the headline numbers
#
# Needs: Python with torch (CUDA), triton, transformers, safetensors, msgpack, xxhash, pytest.
# Installs nothing and reaches no network; does not need gguf (no GGUF default model is used).
# Budget: well under 10 minutes on one H200 (each step has its own timeout; steps run even if an
# earlier one failed, and the exit status is non-zero if any failed).
#
#   OUT=/some/dir scripts/gpu_check.sh
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

step() {  # step NAME TIMEOUT_S COMMAND...: run, time, record the exit status
  local name=$1 limit=$2; shift 2
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
import json, platform, sys
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
print(json.dumps(info))
json.dump(info, open(sys.argv[1], "w"), indent=1)
sys.exit(0 if torch.cuda.is_available() else 1)
EOF

step tests 200 "$PYTHON" -m pytest -q -p no:cacheprovider --durations=15 --junitxml="$OUT/pytest.xml" \
  tests/gpu tests/kernels 2>&1 | tee "$OUT/pytest.txt"
STATUS[tests]=${PIPESTATUS[0]}

# Build the random-weight Qwen3-0.6B checkpoint once (both benchmarks reuse it).
step model 90 "$PYTHON" -c "from bench.models import make_bench_model; print(make_bench_model('qwen3-0.6b', '$MODELS'))"

step offline 180 "$PYTHON" -m bench.offline --shape qwen3-0.6b --model-dir "$MODELS" --skip-hf \
  --num-seqs 256 --min-input 100 --max-input 1024 --min-output 100 --max-output 1024 \
  --max-model-len 4096 --max-num-seqs 256 --max-num-batched-tokens 16384 | tee "$WORK/offline.out"
STATUS[offline]=${PIPESTATUS[0]}
json_line "$WORK/offline.out" > "$OUT/offline.json"

step decode_latency 120 "$PYTHON" -m bench.decode_latency --shape qwen3-0.6b --model-dir "$MODELS" \
  --modes graph,eager --batch-sizes 1,8,32,128 --prompt-len 128 --output-len 128 | tee "$WORK/decode.out"
STATUS[decode_latency]=${PIPESTATUS[0]}
json_line "$WORK/decode.out" > "$OUT/decode_latency.json"

# The same engine with and without the fused Triton ops, side by side: what a graphed step launches.
mkdir -p "$WORK/timeline"
for variant in fused torch; do
  fused=1; [ "$variant" = torch ] && fused=0
  NANOVLLM_TRITON_FUSED=$fused step "timeline_$variant" 180 "$PYTHON" -m bench.decode_latency --shape qwen3-0.6b \
    --model-dir "$MODELS" --modes graph --batch-sizes 1,64 --prompt-len 128 --output-len 256 \
    --timeline "$WORK/timeline/$variant" --timeline-steps 50 | tee "$WORK/timeline/$variant.out"
  STATUS[timeline_$variant]=${PIPESTATUS[0]}
done
tar -czf "$OUT/timeline.tar.gz" -C "$WORK" timeline

STATUS_JSON="{"
for name in "${!STATUS[@]}"; do STATUS_JSON+="\"$name\": ${STATUS[$name]}, "; done
STATUS_JSON="${STATUS_JSON%, }}"
"$PYTHON" - "$OUT" "$STATUS_JSON" "$WORK/timeline" <<'EOF'
import glob, json, os, sys
out, status, timeline_dir = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]

def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.loads(f.read() or "null")
    except (OSError, ValueError):
        return None

offline, decode = load("offline.json"), load("decode_latency.json")
summary = {"exit_status": status, "env": load("env.json"),
           "offline_out_tok_s": offline and offline.get("nanovllm_out_tok_s"),
           "offline_output_tokens": offline and offline.get("output_tokens"),
           "offline_s": offline and offline.get("nanovllm_s"),
           "nano_vllm_published_out_tok_s": {"nano-vllm, RTX 4070 laptop": 1434, "vLLM, RTX 4070 laptop": 1362}}
if decode:
    rows = {(r["mode"], r["batch"]): r for r in decode["rows"]}
    summary["batch1_itl_ms"] = {mode: rows[(mode, 1)]["median_step_ms"] for mode in ("graph", "eager") if (mode, 1) in rows}
    summary["graph_speedup_over_eager"] = decode.get("graph_speedup")
timelines = {}
for path in sorted(glob.glob(os.path.join(timeline_dir, "*.json"))):
    t = json.load(open(path))
    timelines[os.path.basename(path)[:-5]] = {k: t[k] for k in (
        "kernels_per_step", "kernel_us_per_step", "busy_us_per_step", "wall_ms_per_step")}
summary["decode_timelines"] = timelines
print(json.dumps(summary, indent=1))
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
EOF

rm -rf "$WORK"
for rc in "${STATUS[@]}"; do [ "$rc" -eq 0 ] || return 1; done
}

main 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
