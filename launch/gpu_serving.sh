#!/usr/bin/env bash
# The end-to-end serving figures recorded in docs/BENCHMARKS.md: a Qwen3-0.6B-shaped
# model (random bf16 weights, made here), both nodes on one GPU, 1,024 input and
# 128 output tokens, Poisson arrivals.
#   bash launch/gpu_serving.sh OUT_DIR [KV_TRANSFER=ipc] [GROUPS="8,16,24:200 40,60,80,100:600"]
# Each group is RATES:NUM_PROMPTS (more prompts at high rates, so each rate runs
# for seconds). OUT_DIR gets serving-<backend>-<group>.json, the stats and the log.
set -uo pipefail
out="${1:?OUT_DIR}"; backend="${2:-ipc}"; groups="${3:-8,16,24:200 40,60,80,100:600}"
py="${PYTHON:-python3}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
model="${PDSERVE_BENCH_MODEL:-/tmp/pdserve-qwen3-0.6b-shape}"
if [ ! -f "$model/config.json" ]; then
    "$py" -m launch.make_tiny_model "$model" --layers 28 --hidden-size 1024 --intermediate-size 3072 \
        --heads 16 --kv-heads 8 --head-dim 128 --vocab-size 151936 --max-position-embeddings 40960 \
        --dtype bfloat16 --weight-std 0.02 >/dev/null || exit 1
fi
port=5600
bash launch/start_cluster.sh --model "$model" --prefill-device cuda:0 --decode-device cuda:0 \
    --kv-transfer "$backend" --kv-cache-memory 12GiB --max-batch-size 128 --base-port $port \
    --ready-timeout 300 > "$out/cluster-$backend.out" 2> "$out/cluster-$backend.log" &
launcher=$!
for _ in $(seq 600); do grep -q PDSERVE_ENDPOINT "$out/cluster-$backend.out" 2>/dev/null && break
    kill -0 $launcher 2>/dev/null || { echo "cluster failed to start" >&2; tail -20 "$out/cluster-$backend.log" >&2; exit 1; }
    sleep 0.5; done
rc=0
for g in $groups; do
    "$py" -m launch.bench_serving --endpoint "tcp://127.0.0.1:$port" --input-len 1024 --output-len 128 \
        --num-prompts "${g#*:}" --request-rate "${g%:*}" --slo ttft_ms=500 --quiet \
        --save-json "$out/serving-$backend-${g%%,*}.json" || rc=1
done
"$py" -m frontend.client --endpoint "tcp://127.0.0.1:$port" --stats > "$out/stats-$backend.json"
kill -TERM $launcher; wait $launcher
exit $rc
