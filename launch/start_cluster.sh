#!/usr/bin/env bash
# Start a pdserve cluster: the frontend, prefill nodes and decode nodes (xPyD).
#
#   bash launch/start_cluster.sh [--demo] [--model DIR] [--host 127.0.0.1] [--base-port 5600]
#        [--prefill-devices D[,D...]] [--decode-devices D[,D...]]      one node per device listed
#        [--num-prefill N] [--num-decode M]     N or M nodes on the one device given (default 1)
#        [--kv-transfer auto|ipc|tcp] [--dtype T] [--kv-cache-memory SIZE] [--max-batch-size N]
#        [--ready-timeout S] [--prefill-arg ARG]... [--decode-arg ARG]...
#
# Endpoints derive from the base port: clients connect to BASE, nodes to the
# frontend at BASE+1, and decode node i takes KV handoffs at BASE+2+i.
# --prefill-device / --decode-device are the one-device spellings.
# With no --model, a tiny random Qwen3 is made on first use (no download).
# SIGINT/SIGTERM stop every process; if one process dies, the rest are stopped.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

MODEL="" PREFILL_DEVICES=cpu DECODE_DEVICES=cpu NUM_PREFILL="" NUM_DECODE="" HOST=127.0.0.1
BASE_PORT=5600 DEMO=0 DTYPE="" KV_MEM="" MAX_BATCH=64 READY_TIMEOUT=300 KV_TRANSFER=auto
PREFILL_EXTRA=() DECODE_EXTRA=()
usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
    case "$1" in
        --model) MODEL="$2"; shift 2 ;;
        --prefill-device|--prefill-devices) PREFILL_DEVICES="$2"; shift 2 ;;
        --decode-device|--decode-devices) DECODE_DEVICES="$2"; shift 2 ;;
        --num-prefill) NUM_PREFILL="$2"; shift 2 ;;
        --num-decode) NUM_DECODE="$2"; shift 2 ;;
        --kv-transfer) KV_TRANSFER="$2"; shift 2 ;;
        --host) HOST="$2"; shift 2 ;;
        --base-port) BASE_PORT="$2"; shift 2 ;;
        --dtype) DTYPE="$2"; shift 2 ;;
        --kv-cache-memory) KV_MEM="$2"; shift 2 ;;
        --max-batch-size) MAX_BATCH="$2"; shift 2 ;;
        --ready-timeout) READY_TIMEOUT="$2"; shift 2 ;;
        --prefill-arg) PREFILL_EXTRA+=("$2"); shift 2 ;;
        --decode-arg) DECODE_EXTRA+=("$2"); shift 2 ;;
        --demo) DEMO=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "start_cluster: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done

# One device per node: a list gives one node each; a count repeats the one device.
devices_for() {  # devices_for LIST COUNT ROLE -> one device per line
    local list="$1" count="$2" role="$3" d
    IFS=, read -r -a d <<< "$list"
    if [ -n "$count" ]; then
        if [ "${#d[@]}" != 1 ]; then
            echo "start_cluster: give --num-$role with one --$role-devices device, not ${#d[@]}" >&2; exit 2
        fi
        if ! [[ "$count" =~ ^[1-9][0-9]*$ ]]; then
            echo "start_cluster: --num-$role needs a positive integer, got '$count'" >&2; exit 2
        fi
        for _ in $(seq "$count"); do echo "${d[0]}"; done
    else
        printf '%s\n' "${d[@]}"
    fi
}
mapfile -t PREFILL_DEVS < <(devices_for "$PREFILL_DEVICES" "$NUM_PREFILL" prefill)
mapfile -t DECODE_DEVS < <(devices_for "$DECODE_DEVICES" "$NUM_DECODE" decode)
[ "${#PREFILL_DEVS[@]}" -gt 0 ] && [ "${#DECODE_DEVS[@]}" -gt 0 ] || exit 2

if [ -z "$MODEL" ]; then
    MODEL="${PDSERVE_HOME:-$HOME/.cache/pdserve}/tiny-qwen3"
    if [ ! -f "$MODEL/config.json" ]; then
        echo "[pdserve] making a tiny random Qwen3 at $MODEL" >&2
        "$PY" -m launch.make_tiny_model "$MODEL" >/dev/null
    fi
fi

if [[ "$HOST" == *:* ]]; then ADDR="[$HOST]"; else ADDR="$HOST"; fi
CLIENTS="tcp://$ADDR:$BASE_PORT"
NODES="tcp://$ADDR:$((BASE_PORT + 1))"
COMMON=(--model "$MODEL" --max-batch-size "$MAX_BATCH" --kv-transfer "$KV_TRANSFER")
[ -n "$DTYPE" ] && COMMON+=(--dtype "$DTYPE")
[ -n "$KV_MEM" ] && COMMON+=(--kv-cache-memory "$KV_MEM")
REMOTE=()
case "$HOST" in 127.*|localhost|::1) ;; *) REMOTE=(--allow-remote) ;; esac

PIDS=()
cleanup() {
    trap - INT TERM
    local pid
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for _ in $(seq 100); do  # up to 10 s for a graceful stop
        local alive=0
        for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ $alive = 0 ] && break
        sleep 0.1
    done
    for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap 'echo "[pdserve] stopping" >&2; cleanup; exit 130' INT
trap 'echo "[pdserve] stopping" >&2; cleanup; exit 143' TERM

"$PY" -m frontend --model "$MODEL" --clients "$CLIENTS" --nodes "$NODES" "${REMOTE[@]}" &
PIDS+=($!)
for i in "${!DECODE_DEVS[@]}"; do
    "$PY" -m decode_node "${COMMON[@]}" --device "${DECODE_DEVS[$i]}" --name "decode-$i" \
        --frontend "$NODES" --kv-bind "tcp://$ADDR:$((BASE_PORT + 2 + i))" \
        "${REMOTE[@]}" "${DECODE_EXTRA[@]}" &
    PIDS+=($!)
done
for i in "${!PREFILL_DEVS[@]}"; do
    "$PY" -m prefill_node "${COMMON[@]}" --device "${PREFILL_DEVS[$i]}" --name "prefill-$i" \
        --frontend "$NODES" "${REMOTE[@]}" "${PREFILL_EXTRA[@]}" &
    PIDS+=($!)
done
NUM_NODES=$(( ${#PREFILL_DEVS[@]} + ${#DECODE_DEVS[@]} ))

all_alive() { local pid; for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null || return 1; done; }

# Ready means the frontend has heard from both nodes: a handshake, not a sleep.
deadline=$((SECONDS + READY_TIMEOUT))
until "$PY" -m frontend.client --endpoint "$CLIENTS" --wait-ready 2 --wait-nodes "$NUM_NODES" \
        >/dev/null 2>&1; do
    if ! all_alive; then
        echo "[pdserve] a process exited during start-up; stopping" >&2
        cleanup; exit 1
    fi
    if [ $SECONDS -ge $deadline ]; then
        echo "[pdserve] not ready after ${READY_TIMEOUT}s; stopping" >&2
        cleanup; exit 1
    fi
done
echo "[pdserve] ready: ${#PREFILL_DEVS[@]} prefill + ${#DECODE_DEVS[@]} decode nodes; clients connect to $CLIENTS (pids ${PIDS[*]})" >&2
echo "PDSERVE_ENDPOINT=$CLIENTS"

if [ $DEMO = 1 ]; then
    rc=0
    "$PY" -m frontend.client --endpoint "$CLIENTS" --max-tokens 24 --ignore-eos \
        --prompt "The prefill node computes the prompt" \
        --prompt "Hello, world! How are you?" \
        --prompt "café naïve résumé" || rc=$?
    "$PY" -m frontend.client --endpoint "$CLIENTS" --max-tokens 24 --temperature 0.8 --seed 7 \
        --prompt "A streamed, sampled answer:" || rc=$?
    echo "[pdserve] demo done; stopping" >&2
    cleanup
    exit $rc
fi

# Serve until a signal arrives or any process exits; then stop the rest.
wait -n "${PIDS[@]}" || true
echo "[pdserve] a process exited; stopping the cluster" >&2
cleanup
exit 1
