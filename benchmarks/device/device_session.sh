#!/usr/bin/env bash
# One device call that runs several stages of device_run.sh within a deadline, then packs every
# result into one archive (the device tool brings back at most 8 files from $OUT).
# On the GPU machine, from the repository root:
#   source .device/setup.sh && bash benchmarks/device/device_session.sh TAG DEADLINE_S STAGE:LIMIT_S ...
# A stage starts only if its limit still fits before the deadline, so the call ends with its
# results packed instead of being killed at the tool's limit. STAGE may set variables first:
#   SOAK_CALLS=10000,soak2:300   (comma-separated NAME=VALUE before the stage name)
set -u
tag=$1 deadline=$2
shift 2
results=${RESULTS:-/tmp/arfusion-results-$tag}
mkdir -p "$results" "${OUT:?}"
log="$OUT/log_$tag.txt"
start=$SECONDS
for spec in "$@"; do
  limit=${spec##*:}
  body=${spec%:*}
  IFS=, read -r -a parts <<<"$body"
  name=${parts[-1]}
  left=$((deadline - (SECONDS - start)))
  if ((limit > left)); then
    echo "=== $name skipped: limit ${limit}s, ${left}s left before the deadline" | tee -a "$log"
    continue
  fi
  env "${parts[@]:0:${#parts[@]}-1}" OUT="$results" LIMIT="$limit" bash benchmarks/device/device_run.sh "$name" 2>&1 | tee -a "$log"
done
echo "=== session $tag: $((SECONDS - start))s" | tee -a "$log"
tar czf "$OUT/results_$tag.tgz" -C "$results" . 2>&1 | tail -2
