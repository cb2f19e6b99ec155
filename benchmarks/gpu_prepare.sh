#!/usr/bin/env bash
# What gpu_check.sh needs that the GPU machine cannot fetch, built here into outputs/gpu (about 25 MB, to carry):
#
#     bash benchmarks/gpu_prepare.sh [OUT]              # default outputs/gpu; needs apt-get, dpkg-deb, pip
#
# OUT/joined/{train,validation}.jsonl.xz  the joined corpus (benchmarks/corpora.py --corpus joined: every corpus's
#                                         packages and Python's documentation, >= 100 MB of training text)
# OUT/tokenizer/                          the tokenizer pretrain.py trains on it (V 2000), so the GPU spends no time on it
# OUT/wheels/                             datasets and the two packages of its own the GPU machine lacks (dill,
#                                         multiprocess), for its Python 3.12, the versions this environment has
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-outputs/gpu}"
PY="${PYTHON:-.venv/bin/python}"
mkdir -p "$OUT/joined" "$OUT/wheels"
[ -f outputs/corpora/joined/stats.json ] \
    || "$PY" benchmarks/corpora.py --corpus joined --output_dir outputs/corpora --workdir outputs/corpora-work
for split in train validation; do
    [ -f "$OUT/joined/$split.jsonl.xz" ] || xz -T0 -6 -c "outputs/corpora/joined/$split.jsonl" >"$OUT/joined/.$split.xz"
    [ -f "$OUT/joined/.$split.xz" ] && mv "$OUT/joined/.$split.xz" "$OUT/joined/$split.jsonl.xz"
done
"$PY" - <<'PY'
import json
stats = json.load(open("outputs/corpora/joined/stats.json"))
mb = stats["train_chars"] / 1e6
print(f"joined: {stats['train_documents']:,} training documents, {mb:.1f} M characters")
assert mb >= 100, "the quality step needs at least 100 MB of training text"
PY
if [ ! -f "$OUT/tokenizer/tokenizer.json" ]; then  # the tokenizer pretrain.py trains on it, as the quality step asks
    "$PY" - "$OUT/tokenizer" <<'PY'
import sys

sys.path.insert(0, "benchmarks")
import quality

argv = ["--train_file", "outputs/corpora/joined/train.jsonl", "--validation_file",
        "outputs/corpora/joined/validation.jsonl", "--vocab_size", "2000", "--block_size", "64",
        "--preprocessing_num_workers", "2", "--output_dir", "outputs/gpu-prep"]
data, _, _ = quality.shared_data(argv)
data.tokenizer.save_pretrained(sys.argv[1])
PY
fi
versions=$("$PY" -c "import datasets, dill, multiprocess as m; print(f'datasets=={datasets.__version__} dill=={dill.__version__} multiprocess=={m.__version__}')")
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform any -d "$OUT/wheels" $versions
for wheel in datasets dill multiprocess; do
    compgen -G "$OUT/wheels/$wheel-*.whl" >/dev/null || { echo "error: no $wheel wheel in $OUT/wheels"; exit 1; }
done
du -sh "$OUT"
