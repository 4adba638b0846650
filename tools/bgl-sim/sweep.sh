#!/usr/bin/env bash
# Runs bgl-sim once per value of one flag and collects the summaries into one CSV:
#   tools/bgl-sim/sweep.sh BGL_SIM FLAG "V1 V2 ..." OUT.csv [bgl-sim arguments...]
# e.g. tools/bgl-sim/sweep.sh build/tools/bgl-sim/bgl-sim --seq-len "4096 8192 16384" \
#        seq.csv --model models/glm-423b-a30b.json --iterations 300
set -euo pipefail
if (($# < 4)); then
  sed -n '2,5p' "$0" >&2
  exit 2
fi
sim=$1 flag=$2 values=$3 out=$4
shift 4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
header=
for v in $values; do
  "$sim" "$@" "$flag" "$v" --out "$tmp/$v" >/dev/null
  if [[ -z $header ]]; then
    header=1
    echo "value,$(head -1 "$tmp/$v/summary.csv")" >"$out"
  fi
  tail -n +2 "$tmp/$v/summary.csv" | sed "s/^/$v,/" >>"$out"
done
echo "wrote $out" >&2
