#!/usr/bin/env bash
# Issue 27's GPU figures in one stay on the H200: Gemma-3-270M and SmolLM2-135M through the paths a
# user takes (bench/through_save.py), and Gemma's ablation/window table (bench/gemma.py), under the
# transformers versions the project supports, carried as wheels (the machine's own 5.17 builds
# Gemma's GGUF tokenizer wrongly: bench/RESULTS.md, 2026-12-02).
#
# Here, once (Gemma terms: the GGUFs never enter the repository; .gpu/ is ignored):
#   bash bench/gpu_through_save.sh pack GEMMA_GGUF SMOL_GGUF WHEEL_DIR TF_WHEEL...   # .gpu/b0 .. .gpu/bN
# There, one call per part right after each other (the machine stays warm 30 s; /root/b stays):
#   carry [".gpu/bK"]:  bash bench/gpu_through_save.sh append .gpu/bK
# and in the call that carries the last part:
#   bash bench/gpu_through_save.sh append .gpu/bN && bash bench/gpu_through_save.sh setup && \
#   bash bench/background.sh start ts bash /root/repo/bench/gpu_through_save.sh run WHAT@VERSION...
# then `bash bench/background.sh wait ts 560` until it ends; JSON and logs in /root/r (copy to $OUT).
set -euo pipefail
root=${BUNDLE_ROOT:-/root}
case "${1:-}" in
  pack)
    gemma=$2; smol=$3; wheels=$4; shift 4
    work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
    mkdir -p "$work/m" "$work/d" "$work/whl" "$work/tf"
    ln -s "$(realpath "$gemma")" "$work/m/gemma.gguf"; ln -s "$(realpath "$smol")" "$work/m/smol.gguf"
    cp ../shared/data/corpus/{austen,shakespeare,kjv,python-docs}.txt.xz ../shared/data/wikitext-2-raw/wiki.test.raw "$work/d/"
    cp "$wheels"/*.whl "$work/whl/"; cp "$@" "$work/tf/"
    (cd "$work" && sha256sum m/* > SHA256SUMS && tar chf all.tar m d whl tf SHA256SUMS)
    rm -rf .gpu/b[0-9]*
    split -b 55000000 -d -a 1 "$work/all.tar" "$work/part"
    for p in "$work"/part[0-9]; do i=${p##*part}; mkdir -p ".gpu/b$i" && mv "$p" ".gpu/b$i/part"; done
    sha256sum "$work/all.tar" | cut -d' ' -f1 > "$(ls -d .gpu/b[0-9] | tail -1)/sha256"
    ls -l .gpu/b*/part
    ;;
  append)
    mkdir -p "$root/b"
    [ "$(basename "$2")" = b0 ] && rm -f "$root/b/all.tar"
    cat "$2"/part >> "$root/b/all.tar"
    [ -f "$2/sha256" ] && cp "$2/sha256" "$root/b/sha256"
    ls -l "$root/b/all.tar"
    ;;
  setup)
    echo "$(cat "$root/b/sha256")  $root/b/all.tar" | sha256sum -c -
    mkdir -p "$root/x" && tar xf "$root/b/all.tar" -C "$root/x" && (cd "$root/x" && sha256sum -c SHA256SUMS)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$root"/x/whl/*.whl
    for w in "$root"/x/tf/transformers-*.whl; do
      v=$(basename "$w" | cut -d- -f2)
      python3 -m pip install -q --no-index --no-deps --no-compile --target "/tmp/tf$v" "$w"
    done
    # a copy of the tree: later calls re-send the checkout, which must not change what a run reads
    rm -rf "$root/repo" && mkdir -p "$root/repo" && tar cf - --exclude=./.gpu . | tar xf - -C "$root/repo"
    (cd "$root/repo" && python3 -m pip install --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -1)
    ;;
  run)
    shift
    cd "$root/repo"
    mkdir -p "$root/r"; x=$root/x/d; cal="$x/austen.txt.xz $x/shakespeare.txt.xz $x/kjv.txt.xz"
    for job in "$@"; do  # job: WHAT@VERSION, WHAT in gemma-ts, smol-ts, gemma-table
      what=${job%@*}; v=${job#*@}
      export PYTHONPATH=/tmp/tf$v:/tmp/site PYTHONUNBUFFERED=1
      echo "== $what, transformers $v, $(date -u +%T)"
      case "$what" in
        gemma-ts) python3 bench/through_save.py --model "$root/x/m/gemma.gguf" --eval "$x/wiki.test.raw" --label "$v" \
                    --workdir "$root/w" --json "$root/r/through_save_gemma_$v.json" ;;
        smol-ts)  python3 bench/through_save.py --model "$root/x/m/smol.gguf" --eval "$x/wiki.test.raw" --label "$v" \
                    --workdir "$root/w" --json "$root/r/through_save_smol_$v.json" ;;
        gemma-table) python3 bench/gemma.py --model "$root/x/m/gemma.gguf" --calibration $cal --eval "$x/wiki.test.raw" \
                    --held-out "$x/python-docs.txt.xz" --json "$root/r/gemma_$v.json" ;;
      esac || echo "== $what@$v failed"
    done
    echo "== done $(date -u +%T)"
    ;;
  *)
    echo "usage: $0 pack GEMMA SMOL WHEEL_DIR TF_WHEEL... | append .gpu/bK | setup | run WHAT@VERSION..." >&2; exit 2
    ;;
esac
