#!/usr/bin/env bash
# The GPU benchmarks recorded in docs/BENCHMARKS.md, in one go. Each line of
# output is one JSON record; OUT_DIR (default .) also gets the node logs.
#   bash launch/gpu_bench.sh [OUT_DIR]
set -uo pipefail
out="${1:-.}"
py="${PYTHON:-python3}"
run() { echo "# $*" >&2; timeout 400 "$py" -m "$@"; }
run launch.bench.decode --shape qwen3-0.6b --batch-sizes 1,64 --context-len 256 --baseline transformers \
    --node-log "$out/decode-0.6b.log"
run launch.bench.decode --shape qwen3-14b --batch-sizes 1 --context-len 256 --baseline transformers \
    --max-tokens 1024 --node-log "$out/decode-14b.log"
run launch.bench.prefill --shape qwen3-0.6b --batch 8 --prompt-len 1024 --baseline transformers \
    --node-log "$out/prefill-0.6b.log"
run launch.bench.prefill --shape qwen3-14b --batch 8 --prompt-len 1024 --baseline transformers \
    --node-log "$out/prefill-14b.log"
