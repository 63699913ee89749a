#!/usr/bin/env bash
# The end-to-end serving figures recorded in docs/BENCHMARKS.md: a Qwen3-0.6B-shaped
# model (random bf16 weights, made here), both nodes on one GPU, 1,024 input and
# 128 output tokens, Poisson arrivals.
#   bash launch/gpu_serving.sh OUT_DIR [KV_TRANSFER=ipc] [GROUPS="8,16,24:200 40,60,80,100:600"] [INTERFACES="zmq http"]
# Each group is RATES:NUM_PROMPTS (more prompts at high rates, so each rate runs
# for seconds). Each interface runs every group against the same cluster: zmq
# through pdserve's client, http through the OpenAI API (streamed completions).
# OUT_DIR gets serving-<backend>-<interface>-<group>.json (with per-request
# samples: `pdserve bench --replot F.json --plot F.png` draws them anywhere),
# a PNG per interface where matplotlib is installed, the stats and the log.
set -uo pipefail
out="${1:?OUT_DIR}"; backend="${2:-ipc}"; groups="${3:-8,16,24:200 40,60,80,100:600}"
interfaces="${4:-zmq http}"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh"
bench_model
port=5600 http_port=8000
start_bench_cluster "$out" "$backend" --kv-transfer "$backend" --base-port $port --http-port $http_port
rc=0
has_plot=0; "$py" -c "import matplotlib" 2>/dev/null && has_plot=1
for interface in $interfaces; do
    if [ "$interface" = http ]; then target=(--base-url "http://127.0.0.1:$http_port")
    else target=(--endpoint "tcp://127.0.0.1:$port"); fi
    for g in $groups; do
        "$py" -m launch.bench.serving "${target[@]}" --input-len 1024 --output-len 128 \
            --num-prompts "${g#*:}" --request-rate "${g%:*}" --slo ttft_ms=500 --quiet \
            --save-json "$out/serving-$backend-$interface-${g%%,*}.json" || rc=1
    done
    # One plot over every group of this interface.
    "$py" - "$out" "$backend" "$interface" <<'PYEOF'
import glob, json, sys
out, backend, interface = sys.argv[1:]
records = [r for f in sorted(glob.glob(f"{out}/serving-{backend}-{interface}-*.json"))
           for r in json.load(open(f))]
records.sort(key=lambda r: float(r["request_rate"]))
json.dump(records, open(f"{out}/sweep-{backend}-{interface}.json", "w"), indent=1)
PYEOF
    [ $has_plot = 1 ] && "$py" -m launch.bench.serving --replot "$out/sweep-$backend-$interface.json" \
        --plot "$out/sweep-$backend-$interface.png"
done
"$py" -m frontend.cli --endpoint "tcp://127.0.0.1:$port" --stats --json > "$out/stats-$backend.json"
kill -TERM $launcher; wait $launcher
exit $rc
