#!/usr/bin/env bash
# Every GPU check in one go, on one CUDA device, within 14 minutes (each step has its own time limit too):
#
#     bash benchmarks/gpu_prepare.sh                    # first, on a machine with the package registries (see there)
#     bash benchmarks/gpu_check.sh [RESULTS_DIR] [STEP...]   # RESULTS_DIR default benchmarks/results; STEPs: below
#
# quality        quality.py at the device-sized step on the joined corpus (>= 100 MB of text, carried in outputs/gpu):
#                BriLLM's defaults at node size 32, 64 and 128 beside GPT-2 4L/256 and 6L/384, 2 minutes each (~13 min)
# selfcheck      every Triton kernel against its torch reference
# throughput     training at the paper's shape (V 4000, 0.96B parameters), 32 x 32 and 1024 x 64, torch path and
#                kernels side by side, and greedy and sampled generate() at batch 1 and 256
# fsdp           a tiny pretrain.py run under gpu8_fsdp.yaml on one GPU: trains, keeps its best model, saves a folder
#                that loads and generates (fsdp_load)
# default_batch  gpu_throughput.py --default_batch: pretrain.py's default step at the paper's shape, the batch
#                GPU_STEP_TOKENS chose, its tokens/s
# cuda_tests     pytest -k cuda
# The steps run in that order (all of them without a STEP); one that does not start before the 14 minutes are out is
# reported as skipped, one that fails or runs out of time is reported and the next one runs. Figures go to
# RESULTS_DIR as the benchmarks' records; every step's output to RESULTS_DIR/gpu_check-<step>.log.
# The machine needs torch, triton and transformers; what it lacks of `datasets` is installed from the wheels
# gpu_prepare.sh put in outputs/gpu/wheels. GPU_CHECK_ON_CPU=1 runs the named steps on the CPU at tiny settings (the
# test suite's check that the script works; no figure of it means anything).
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${1:-benchmarks/results}"
shift || true
STEPS="${*:-quality selfcheck throughput fsdp default_batch cuda_tests}"
DEADLINE=$((SECONDS + ${GPU_CHECK_SECONDS:-840}))
PY="${PYTHON:-python3}"
GPU_DATA="${GPU_DATA:-outputs/gpu}"
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0

step() {  # step NAME SECONDS COMMAND...: run it if asked and time is left, within min(SECONDS, time left)
    local name=$1 limit=$2
    shift 2
    [[ " $STEPS " == *" ${name%_load} "* ]] || return 0
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 20 ]; then
        printf '%-14s skipped: the script is out of its time\n' "$name"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local started=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$RESULTS/gpu_check-$name.log" 2>&1
    local rc=$? verdict=ok
    { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && verdict="out of time ($limit s)"
    [ $rc -ne 0 ] && [ "$verdict" = ok ] && verdict="failed (exit $rc)"
    [ $rc -ne 0 ] && status=1
    printf '%-14s %-22s %4d s   %s\n' "$name" "$verdict" $((SECONDS - started)) "$RESULTS/gpu_check-$name.log"
    tail -n 3 "$RESULTS/gpu_check-$name.log" | sed 's/^/    /'
}

if [ "${GPU_CHECK_ON_CPU:-0}" = 1 ]; then
    export CUDA_VISIBLE_DEVICES=""
else
    "$PY" -c "import torch; assert torch.cuda.is_available(); print(torch.cuda.get_device_name())" 2>/dev/null \
        || { echo "gpu_check.sh needs a CUDA device (torch sees none)"; exit 2; }
fi
if ! "$PY" -c "import datasets" 2>/dev/null; then  # the training scripts need it; the GPU machine lacks it
    compgen -G "$GPU_DATA/wheels/*.whl" >/dev/null \
        || { echo "no datasets here and no wheels in $GPU_DATA/wheels: run benchmarks/gpu_prepare.sh first"; exit 2; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/brillm-site "$GPU_DATA"/wheels/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/brillm-site" || exit 2
fi

corpus=$(mktemp -d)
for split in train validation; do  # the joined corpus, carried compressed
    [ -f "$GPU_DATA/joined/$split.jsonl.xz" ] && "$PY" -c "import lzma, shutil, sys
with lzma.open(sys.argv[1]) as src, open(sys.argv[2], 'wb') as dst: shutil.copyfileobj(src, dst, 1 << 24)" \
        "$GPU_DATA/joined/$split.jsonl.xz" "$corpus/$split.jsonl"
done
if [ "${GPU_CHECK_ON_CPU:-0}" = 1 ]; then  # tiny settings: the script's plumbing, not a measurement
    quality=(--node_sizes 4 8 --gpt2 1x16x2 2x16x2 --gpt2_batch 8 --budgets 0.5 --curve_points 1 --vocab_size 300
             --block_size 16 --threads 1 "--pretrain_flags=--no-keep_best_model --preprocessing_num_workers 2")
else
    quality=(--node_sizes 32 64 128 --gpt2 4x256@1e-3 6x384@1e-3 --gpt2_batch 1024 --budgets 120 --curve_points 4
             --vocab_size 2000 --block_size 64 --max_eval_blocks 2048 --threads 8
             "--pretrain_flags=--no-keep_best_model --preprocessing_num_workers 16")
fi
# the tokenizer pretrain.py would train on the corpus, trained by gpu_prepare.sh: a minute less here
[ -f "$GPU_DATA/tokenizer/tokenizer.json" ] && quality+=(--tokenizer_name "$GPU_DATA/tokenizer")

if [ -f "$corpus/train.jsonl" ]; then
    # on the GPU, the last model, not the best: a best model of d = 128 is 20 GB, written at each better evaluation;
    # the models stay in a temporary folder, quality.json and quality.png come to RESULTS_DIR (a cut-off run's too)
    step quality 830 "$PY" benchmarks/quality.py --train_file "$corpus/train.jsonl" --validation_file \
        "$corpus/validation.jsonl" "${quality[@]}" --no-wait-quiet --output_dir "$corpus/quality" \
        --results_dir "$RESULTS"
    cp "$corpus"/quality/quality.{json,png} "$RESULTS/" 2>/dev/null
elif [[ " $STEPS " == *" quality "* ]]; then
    echo "quality        skipped: no corpus in $GPU_DATA/joined (benchmarks/gpu_prepare.sh builds it)"
    status=1
fi
step selfcheck 90 "$PY" -m modeling_brillm.selfcheck
step throughput 150 "$PY" benchmarks/gpu_throughput.py --shape paper --batches 32x32,1024x64 --objective exact \
    --optimizer sparse_adamw --decode-batches 1,256 --results_dir "$RESULTS"
out=$(mktemp -d)
step fsdp 100 "$PY" -m accelerate.commands.launch --config_file configuration/accelerate/gpu8_fsdp.yaml \
    --num_processes 1 examples/pretrain.py --vocab_size 512 --block_size 32 --max_train_steps 20 --eval_steps 10 \
    --num_generations 1 --output_dir "$out/fsdp"
step fsdp_load 40 "$PY" - "$out/fsdp" <<'EOF'
import sys

from transformers import AutoModelForCausalLM, AutoTokenizer

import modeling_brillm  # noqa: F401  (registers the brillm type)

model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).cuda()
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
ids = tokenizer("The", return_tensors="pt").input_ids.cuda()
print("loaded; greedy:", repr(tokenizer.decode(model.generate(ids, max_new_tokens=8)[0])))
EOF
step default_batch 150 "$PY" benchmarks/gpu_throughput.py --default_batch 30 --results_dir "$RESULTS"
step cuda_tests 200 "$PY" -m pytest -q -x -n 8 -k cuda -p no:cacheprovider
rm -rf "$out" "$corpus"
exit $status
