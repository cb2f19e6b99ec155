#!/usr/bin/env bash
# Every GPU check in one go, each step with its own time limit, on one CUDA device:
#
#     bash benchmarks/gpu_check.sh [RESULTS_DIR]        # default benchmarks/results
#
# 1. the kernels' self-check (every Triton kernel against its torch reference, and their speed-ups);
# 2. the CUDA tests (`pytest -k cuda`);
# 3. training throughput at the paper's shape (V 4000, 0.96B parameters), 32 x 32 and 1024 x 64, torch path and
#    kernels side by side, and greedy generate() at batch 1 and 256;
# 4. pretrain.py's default step: 60 s of training at the paper's shape with no batch flag (the batch the recipe's
#    GPU_STEP_TOKENS chose for the device's memory, its tokens/s beside step 3's, peak memory beside the estimate);
# 5. FSDP on the device: a tiny pretrain.py run under configuration/accelerate/gpu8_fsdp.yaml on one GPU (trains,
#    keeps its best model, saves a folder that loads and generates).
# A step that fails or runs out of time is reported and the next one runs. Figures go to RESULTS_DIR as the
# benchmarks' JSON records; every step's output to RESULTS_DIR/gpu_check-<step>.log. About 12 minutes in all.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${1:-benchmarks/results}"
mkdir -p "$RESULTS"
PY="${PYTHON:-python}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
status=0

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$RESULTS/gpu_check-$name.log" 2>&1
    local rc=$?
    local verdict=ok
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && verdict="out of time ($limit s)"
    [ $rc -ne 0 ] && [ "$verdict" = ok ] && verdict="failed (exit $rc)"
    [ $rc -ne 0 ] && status=1
    printf '%-10s %-22s %4d s   %s\n' "$name" "$verdict" $((SECONDS - started)) "$RESULTS/gpu_check-$name.log"
    tail -n 3 "$RESULTS/gpu_check-$name.log" | sed 's/^/    /'
}

"$PY" -c "import torch; print(torch.cuda.get_device_name())" 2>/dev/null \
    || { echo "gpu_check.sh needs a CUDA device (torch sees none)"; exit 2; }
step selfcheck 150 "$PY" -m modeling_brillm.selfcheck
step cuda_tests 200 "$PY" -m pytest -q -x -k cuda -p no:cacheprovider
step throughput 240 "$PY" benchmarks/gpu_throughput.py --shape paper --batches 32x32,1024x64 --objective exact \
    --optimizer sparse_adamw --decode-batches 1,256 --long-tokens 0 --results_dir "$RESULTS"
step default_batch 420 "$PY" benchmarks/gpu_default_batch.py --seconds 60 --results_dir "$RESULTS"
out=$(mktemp -d)
step fsdp 150 "$PY" -m accelerate.commands.launch --config_file configuration/accelerate/gpu8_fsdp.yaml \
    --num_processes 1 examples/pretrain.py --vocab_size 512 --block_size 32 --max_train_steps 20 --eval_steps 10 \
    --num_generations 1 --output_dir "$out/fsdp"
step fsdp_load 60 "$PY" - "$out/fsdp" <<'EOF'
import sys

from transformers import AutoModelForCausalLM, AutoTokenizer

import modeling_brillm  # noqa: F401  (registers the brillm type)

model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).cuda()
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
ids = tokenizer("The", return_tensors="pt").input_ids.cuda()
print("loaded; greedy:", repr(tokenizer.decode(model.generate(ids, max_new_tokens=8)[0])))
EOF
rm -rf "$out"
exit $status
