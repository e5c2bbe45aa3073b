#!/usr/bin/env bash
# Everything a GPU run needs, carried to the device machine in as few calls as its 64 MiB limit per
# call allows (../shared/GPU.md): teacher GGUFs, the wheels in .whl/ (fla, fla-core, gguf), optionally
# Triton 3.7.1 (pruned of what an H200 never loads), transformers wheels and the evaluation texts,
# as one xz stream cut into 48 MB parts under .gpu/ (ignored by git). Then runs that outlive one call.
#
#   here:  bash bench/gpu.sh pack [--triton WHEEL] [--tf WHEEL]... [--data] GGUF...     # .gpu/q0 .. .gpu/qN
#   there: one call per part, right after each other (the machine stays warm; $BUNDLE_ROOT stays):
#          carry [".gpu/qK"]:  bash bench/gpu.sh append .gpu/qK
#          after the last:     bash bench/gpu.sh setup      # checks sha256; GGUFs in /root/m, texts in /root/d
#                                                           # and byte-compiles torch, Triton and the checkout (the machines ship no bytecode)
#          eval "$(bash bench/gpu.sh env [TF_VERSION])"    # PYTHONPATH: Triton, a carried transformers, the wheels
#          bash bench/gpu.sh start NAME COMMAND...          # detached (setsid): outlives the call; log /root/bg/NAME.log
#          bash bench/gpu.sh wait NAME SECONDS [FILE...]    # exit 0 once NAME ended (status in /root/bg/NAME.rc), 3 if not,
#                                                           # 4 at once if NAME is not on this machine (it was released);
#                                                           # copies NAME's log, its GPU samples (NAME.gpu: nvidia-smi
#                                                           # dmon, once a second) and each FILE to $OUT on every poll
# setup also copies the checkout to /root/repo and installs it there (-e): later calls re-send the
# checkout, which must not change what a background run reads; run background jobs from /root/repo.
set -euo pipefail
root=${BUNDLE_ROOT:-/root}
bg=${BG_DIR:-$root/bg}
data=${DATA:-/work/shared/data}  # pack --data: the corpus and WikiText-2 test
part_bytes=${PART_BYTES:-48000000}  # with the ~10 MB checkout each call sends, under the 64 MiB a call carries (57 MB parts stopped fitting in the fifty-sixth session)
usage="usage: $0 pack [--triton WHEEL] [--tf WHEEL]... [--data] GGUF... | append .gpu/qK | setup | env [TF_VERSION] | start NAME COMMAND... | wait NAME SECONDS [FILE...]"

pack() {
  local triton="" texts=0 tfs=() models=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --triton) triton=$2; shift 2 ;;
      --tf) tfs+=("$2"); shift 2 ;;
      --data) texts=1; shift ;;
      *) models+=("$1"); shift ;;
    esac
  done
  work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
  mkdir -p "$work/t/m" "$work/t/d" "$work/t/whl" "$work/t/tf" "$work/t/site2"
  for m in "${models[@]}"; do ln -s "$(realpath "$m")" "$work/t/m/$(basename "$m")"; done
  [ -d .whl ] && cp .whl/*.whl "$work/t/whl/"
  [ ${#tfs[@]} -gt 0 ] && cp "${tfs[@]}" "$work/t/tf/"
  if [ "$texts" = 1 ]; then
    cp "$data"/corpus/{austen,shakespeare,kjv,python-docs}.txt.xz "$data"/wikitext-2-raw/wiki.test.raw "$work/t/d/"
  fi
  if [ -n "$triton" ]; then
    python3 -m zipfile -e "$triton" "$work/t/site2"
    local dist; dist=$(cd "$work/t/site2" && ls -d triton-*.dist-info)
    rm -rf "$work/t/site2/triton/backends/amd" "$work/t/site2/triton/instrumentation" \
      "$work/t/site2/triton/backends/nvidia/bin/ptxas-blackwell" "$work/t/site2/triton/backends/nvidia/lib/cupti/"*.a
    sed -i '/^amd *=/d' "$work/t/site2/$dist/entry_points.txt"  # the backend discovery imports every entry point
  fi
  (cd "$work/t" && find m -type l -o -type f | xargs -r sha256sum > SHA256SUMS)
  tar chf - -C "$work/t" . | xz -T0 -6 > "$work/all.tar.xz"
  rm -rf .gpu/q[0-9]*
  split -b "$part_bytes" -d -a 1 "$work/all.tar.xz" "$work/part"
  local parts=("$work"/part[0-9])
  for i in "${!parts[@]}"; do mkdir -p ".gpu/q$i" && mv "${parts[$i]}" ".gpu/q$i/part"; done
  sha256sum "$work/all.tar.xz" | cut -d' ' -f1 > ".gpu/q$((${#parts[@]} - 1))/sha256"
  ls -l .gpu/q*/part
  echo "${#parts[@]} part(s): one call each with carry [\".gpu/qK\"], then setup in the last"
}

setup() {
  echo "$(cat "$root/b/sha256")  $root/b/all.tar.xz" | sha256sum -c -
  rm -rf "$root/x" && mkdir -p "$root/x" "$root/m" "$root/d"
  tar xJf "$root/b/all.tar.xz" -C "$root/x"
  if [ -s "$root/x/SHA256SUMS" ]; then (cd "$root/x" && sha256sum -c --quiet SHA256SUMS); fi
  mv "$root/x/m/"* "$root/m/" 2>/dev/null || true
  mv "$root/x/d/"* "$root/d/" 2>/dev/null || true
  if ls "$root/x/whl/"*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site "$root"/x/whl/*.whl  # byte-compiled, as a user's install is
  fi
  if [ -d "$root/x/site2/triton" ]; then
    rm -rf /tmp/site2 && mv "$root/x/site2" /tmp/site2
    chmod +x /tmp/site2/triton/backends/nvidia/bin/*  # zipfile -e at pack time drops the exec bits (ptxas: PermissionError)
    # pack drops ptxas-blackwell (~30 MB), but Triton 3.9.0 looks it up on Hopper too ("Cannot find ptxas-blackwell",
    # fifty-seventh session); with ptxas in its place the H100 run compiled and passed
    [ -e /tmp/site2/triton/backends/nvidia/bin/ptxas-blackwell ] || ln -s ptxas /tmp/site2/triton/backends/nvidia/bin/ptxas-blackwell
  fi
  for w in "$root"/x/tf/transformers-*.whl; do
    [ -f "$w" ] || continue
    python3 -m pip install -q --no-index --no-deps --no-compile --target "/tmp/tf$(basename "$w" | cut -d- -f2)" "$w"
  done
  rm -rf "$root/repo" && mkdir -p "$root/repo" && tar cf - --exclude=./.gpu . | tar xf - -C "$root/repo"
  (cd "$root/repo" && python3 -m pip install --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -1)
  # The device machines set PYTHONDONTWRITEBYTECODE=1 and their torch comes without bytecode, so every process compiled
  # torch's compiler stack from source (~10 s: twenty-ninth session); a user's pip install byte-compiles, and so does this
  local t0=$SECONDS
  python3 -m compileall -q -j 0 "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" /tmp/site2 "$root/repo" > /dev/null 2>&1 || true
  echo "bytecode compiled in $((SECONDS - t0)) s"
  ls -l "$root/m" "$root/d"
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  append)
    mkdir -p "$root/b"
    [ "$(basename "$2")" = q0 ] && rm -f "$root/b/all.tar.xz"
    cat "$2"/part >> "$root/b/all.tar.xz"
    [ -f "$2/sha256" ] && cp "$2/sha256" "$root/b/sha256"
    ls -l "$root/b/all.tar.xz"
    ;;
  setup) setup ;;
  env)
    path=/tmp/site
    [ -n "${2:-}" ] && path=/tmp/tf$2:$path
    [ -d /tmp/site2/triton ] && path=/tmp/site2:$path
    echo "export PYTHONPATH=$path PYTHONUNBUFFERED=1"
    ;;
  start)
    # While NAME runs, nvidia-smi samples the GPU's power, temperature and clocks once a second into NAME.gpu
    # (where there is an nvidia-smi), which `wait` brings back with the log: twice a later run of a stay read ~10%
    # slower on its latency-bound rows alone (forty-fifth and forty-sixth sessions), as a lower SM clock would.
    name=$2; shift 2
    mkdir -p "$bg" && rm -f "$bg/$name.rc" "$bg/$name.gpu"
    setsid nohup bash -c 'watch=""
      if command -v nvidia-smi > /dev/null; then nvidia-smi dmon -s pc -d 1 -o T > "$0.gpu" 2>&1 & watch=$!; fi
      "$@"; status=$?
      if [ -n "$watch" ]; then kill "$watch" 2> /dev/null; fi
      echo $status > "$0.rc"' "$bg/$name" "$@" > "$bg/$name.log" 2>&1 < /dev/null &
    echo "started $name (pid $!), log $bg/$name.log"
    ;;
  wait)
    name=$2; limit=$3; shift 3; start=$SECONDS
    if [ ! -f "$bg/$name.log" ]; then  # a fresh machine: the one that ran NAME was released (idle past its limit)
      echo "no job $name on this machine ($bg/$name.log is missing): the machine that ran it was released, and its files with it" >&2
      exit 4
    fi
    while [ ! -f "$bg/$name.rc" ] && [ $((SECONDS - start)) -lt "$limit" ]; do sleep 2; done
    tail -c 3000 "$bg/$name.log"
    if [ -n "${OUT:-}" ]; then  # what the run has written so far comes back with every poll, not only after the last
      for f in "$bg/$name.log" "$bg/$name.gpu" "$@"; do [ -f "$f" ] && cp "$f" "$OUT/" || true; done
    fi
    if [ -f "$bg/$name.rc" ]; then echo "$name ended with status $(cat "$bg/$name.rc")"; exit 0; fi
    echo "$name still running after ${limit} s"; exit 3
    ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
