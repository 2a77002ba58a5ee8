#!/usr/bin/env bash
# The main job on the embedded model: one generation in-process with SAE features stored, a query
# of those features, then a prompts file through the Ray actor system (generator, SAE workers,
# store, ingest) on a Ray instance started for this run.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0  # keep the demo's Ray instance on loopback
export RAY_USAGE_STATS_ENABLED=0           # and do not report usage statistics from it
BIN=.venv/bin
echo "== raylens generate (in-process, SAE nearline, legacy mod file) =="
$BIN/raylens generate --prompt "What is the capital of France?" --max-tokens 32 --temperature 0 \
    --mod tests/mods/added/force_tokens.py --sae --request-id demo-inline
echo "== raylens query top: the strongest SAE features of that request =="
$BIN/raylens query top --request-id demo-inline --limit 5
echo "== the actor pipeline on a Ray instance of its own: prompts in, results out =="
rm -f artifacts/demo-results.jsonl
CONCORDANCE_ACTIVATIONS_ENABLED=1 CONCORDANCE_SAE_ENABLED=1 \
    $BIN/python -m pipelines.jobs.generate --address local --prompts scripts/demo-prompts.jsonl \
    --out artifacts/demo-results.jsonl
$BIN/python - <<'PY'
import json
for line in open("artifacts/demo-results.jsonl"):
    r = json.loads(line)
    print(f"{r['request_id']:>14}  {r['finish_reason']:<7} {r['output_text']!r}")
PY
