#!/usr/bin/env bash
# Start a pdserve cluster: the frontend, prefill nodes and decode nodes (xPyD), supervised
# by launch/start_cluster.py (what starts, with what: launch/cluster/plan.py).
#
#   bash launch/start_cluster.sh [--demo] [--model DIR] [--base-port 5600] ...   (--help: every flag)
#
# It prints PDSERVE_ENDPOINT=tcp://HOST:BASE once every node has registered (a --join
# host: PDSERVE_JOINED=ENDPOINT); SIGTERM/SIGINT drain the cluster and stop it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec "$PY" -m launch.start_cluster "$@"
