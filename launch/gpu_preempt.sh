#!/usr/bin/env bash
# The decode-concurrency figures for docs/BENCHMARKS.md: a Qwen3-0.6B-shaped model
# (random bf16 weights, made here), both nodes on one GPU, 1,024-token prompts
# asking for 4,096 tokens and left after 128 (the client stops reading, which
# aborts them); at one KV budget, once with preemption-based admission and once
# with full reservation (--no-preemption). The record's mean_decode_batch and
# num_preemptions come from the decode node.
#   bash launch/gpu_preempt.sh OUT_DIR [RATES=16,inf] [NUM_PROMPTS=256] [KV=4GiB]
# OUT_DIR gets preempt-<on|off>.json (per-request samples included) and the logs.
set -uo pipefail
out="${1:?OUT_DIR}"; rates="${2:-16,inf}"; num="${3:-256}"; kv="${4:-4GiB}"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh"
bench_model
port=5600 rc=0
for mode in on off; do
    extra=(); [ $mode = off ] && extra=(--no-preemption)
    start_bench_cluster "$out" "preempt-$mode" --base-port $port --no-http --kv-cache-memory "$kv" "${extra[@]}"
    "$py" -m launch.bench_serving --endpoint "tcp://127.0.0.1:$port" --input-len 1024 --output-len 128 \
        --max-tokens 4096 --num-prompts "$num" --request-rate "$rates" --quiet \
        --save-json "$out/preempt-$mode.json" || rc=1
    kill -TERM $launcher; wait $launcher
done
exit $rc
