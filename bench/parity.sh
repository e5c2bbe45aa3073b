#!/usr/bin/env bash
# The CLI's perplexities on stories260K in float32 (copy-only baseline, full pipeline, 200k-token
# distillation of the full pipeline), one JSON line each: a refactor must reproduce them bit for bit.
#   bash bench/parity.sh OUT_JSONL     (CPU, ~5 min on 2 cores)
# SURGERY="python -m surgery.cli.app" with PYTHONPATH at another build compares two versions.
# The texts come from SHARED (default: the checkout's shared/, else the folder beside the checkout,
# so a worktree elsewhere sets SHARED=/work/shared); the teacher is the checkout's own copy.
set -euo pipefail
out=${1:?usage: bench/parity.sh OUT_JSONL}
repo=$(cd "$(dirname "$0")/.." && pwd)
shared=${SHARED:-$repo/shared}
[ -d "$shared/data" ] || shared=$repo/../shared
[ -d "$shared/data" ] || { echo "bench/parity.sh: no data/ in $shared; set SHARED to the folder holding data/wikitext-2-raw and data/corpus" >&2; exit 2; }
teacher=$repo/tests/assets/stories260k/stories260K.gguf
wiki=$shared/data/wikitext-2-raw/wiki.test.raw
corpus=$shared/data/corpus/austen.txt.xz
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export SURGERY_CACHE=$work/cache
read -r -a cli <<< "${SURGERY:-surgery}"
common=(--model "$teacher" --device cpu --dtype float32)
"${cli[@]}" apply "${common[@]}" --passes select,replace --out "$work/baseline" 2>/dev/null
"${cli[@]}" apply "${common[@]}" --passes select,replace,calibrate,align --out "$work/full" 2>/dev/null
"${cli[@]}" distill --model "$work/full" --teacher "$teacher" --data "$corpus" --tokens 200k --seq-len 256 --batch-size 8 \
    --out "$work/distilled" --device cpu --json 2>/dev/null > "$work/distill.json"
: > "$out"
for name in baseline full distilled/last; do
  ppl=$("${cli[@]}" eval --model "$work/$name" --text "$wiki" --chunk 512 --device cpu --dtype float32 --json 2>/dev/null)
  python3 -c 'import json,sys; r=json.loads(sys.argv[2]); print(json.dumps({"model": sys.argv[1], "perplexity": r["perplexity"].hex(), "ppl": r["perplexity"], "tokens": r["tokens"]}))' "$name" "$ppl" >> "$out"
done
python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(json.dumps({"model": "distill-loss", "loss": r["loss"].hex(), "value": r["loss"]}))' "$work/distill.json" >> "$out"
cat "$out"
