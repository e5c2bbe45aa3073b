#!/usr/bin/env bash
# The teacher GGUF and Triton 3.7.1 in as few device calls as the 64 MiB working-tree limit allows.
# Raw, they take six calls (98 MB + 198 MB in 48 MB parts); pruned of what an H200 never loads
# (the AMD backend, the Blackwell ptxas, static CUPTI libraries, test libraries) and xz-compressed
# in one stream, they take four (195 MB in 57 MB parts).
#
#   here:  bash bench/gpu_bundle.sh pack GGUF TRITON_WHEEL      # writes .gpu/q0 .. .gpu/qN
#   there: bash bench/gpu_bundle.sh append .gpu/qK               # one call per part, carry .gpu/qK
#          bash bench/gpu_bundle.sh unpack                       # after the last part (same call is fine)
#
# unpack puts the GGUF (its own file name) in $BUNDLE_ROOT/m/ (default /root/m/) and Triton under $SITE2 (default
# /tmp/site2), checking the sha256 that pack wrote beside the last part. Then, as before:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   python3 -m pip install --no-deps --no-build-isolation --no-index -e .   # check it says "installed"
#   export PYTHONPATH=$SITE2:/tmp/site
set -euo pipefail
root=${BUNDLE_ROOT:-/root}
site2=${SITE2:-/tmp/site2}
part_bytes=57000000
case "${1:-}" in
  pack)
    gguf=$2; wheel=$3
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    python3 -m zipfile -e "$wheel" "$work/t"
    dist=$(cd "$work/t" && ls -d triton-*.dist-info)
    rm -rf "$work/t/triton/backends/amd" "$work/t/triton/instrumentation" \
      "$work/t/triton/backends/nvidia/bin/ptxas-blackwell" "$work/t/triton/backends/nvidia/lib/cupti/"*.a
    sed -i '/^amd *=/d' "$work/t/$dist/entry_points.txt"  # the backend discovery imports every entry point
    name=$(basename "$gguf")
    ln -s "$(realpath "$gguf")" "$work/t/$name"
    tar chf - -C "$work/t" "$name" triton "$dist" | xz -T0 -6 > "$work/all.tar.xz"
    rm -rf .gpu/q[0-9]*
    split -b "$part_bytes" -d -a 1 "$work/all.tar.xz" "$work/part"
    parts=("$work"/part*)
    for i in "${!parts[@]}"; do mkdir -p ".gpu/q$i" && mv "${parts[$i]}" ".gpu/q$i/"; done
    sha256sum "$work/all.tar.xz" | cut -d' ' -f1 > ".gpu/q$((${#parts[@]} - 1))/sha256"
    ls -l .gpu/q*/part*
    echo "${#parts[@]} parts: one call each with carry [\".gpu/qK\"], then unpack in the last"
    ;;
  append)
    mkdir -p "$root/b"
    [ "$(basename "$2")" = q0 ] && rm -f "$root/b/all.tar.xz"
    cat "$2"/part* >> "$root/b/all.tar.xz"
    ls -l "$root/b/all.tar.xz"
    [ -f "$2/sha256" ] && cp "$2/sha256" "$root/b/sha256"
    true
    ;;
  unpack)
    echo "$(cat "$root/b/sha256")  $root/b/all.tar.xz" | sha256sum -c -
    mkdir -p "$root/x" "$root/m" "$site2"
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1], 'r:xz').extractall(sys.argv[2])" "$root/b/all.tar.xz" "$root/x"
    mv "$root/x/"*.gguf "$root/m/"
    rm -rf "$site2"/triton "$site2"/triton-*.dist-info
    mv "$root/x/triton" "$root/x/"triton-*.dist-info "$site2/"
    rm -rf "$root/x"
    echo "teacher in $root/m/, Triton under $site2"
    ;;
  *)
    echo "usage: $0 pack GGUF TRITON_WHEEL | append .gpu/qK | unpack" >&2; exit 2
    ;;
esac
