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
bench=(--input-len 1024 --output-len 128 --max-tokens 4096 --num-prompts "$num" --request-rate "$rates")
rc=0
bench_on_cluster "$out" preempt-on --kv-cache-memory "$kv" -- "${bench[@]}" || rc=1
bench_on_cluster "$out" preempt-off --kv-cache-memory "$kv" --no-preemption -- "${bench[@]}" || rc=1
exit $rc
