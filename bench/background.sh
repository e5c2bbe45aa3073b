#!/usr/bin/env bash
# A benchmark that outlives one device call (each call is at most 10 minutes; a process a call
# leaves behind is killed unless it started its own session): start it detached with setsid, then
# poll it from later calls while the machine stays warm.
#
#   bash bench/background.sh start NAME COMMAND...   # returns at once; log in /root/bg/NAME.log
#   bash bench/background.sh wait NAME SECONDS       # until NAME ends or SECONDS pass; tail of the log
#
# `wait` exits 0 once NAME has ended (its exit status is in /root/bg/NAME.rc), 3 while it still runs.
set -uo pipefail
dir=${BG_DIR:-/root/bg}
mkdir -p "$dir"
case "${1:-}" in
  start)
    name=$2; shift 2
    rm -f "$dir/$name.rc"
    setsid nohup bash -c '"$@"; echo $? > "'"$dir/$name.rc"'"' _ "$@" > "$dir/$name.log" 2>&1 < /dev/null &
    echo "started $name (pid $!), log $dir/$name.log"
    ;;
  wait)
    name=$2; limit=$3
    start=$SECONDS
    while [ ! -f "$dir/$name.rc" ] && [ $((SECONDS - start)) -lt "$limit" ]; do sleep 2; done
    tail -c 3000 "$dir/$name.log"
    if [ -f "$dir/$name.rc" ]; then echo "$name ended with status $(cat "$dir/$name.rc")"; exit 0; fi
    echo "$name still running after ${limit} s"; exit 3
    ;;
  *)
    echo "usage: $0 start NAME COMMAND... | wait NAME SECONDS" >&2; exit 2
    ;;
esac
