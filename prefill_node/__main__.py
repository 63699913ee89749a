"""python -m prefill_node --frontend tcp://127.0.0.1:5601 --model DIR

The frontend names the decode node of each request; this node connects to
that decode node's KV link on first use."""
import argparse
import sys

from common.base.config import KV_TRANSFERS, NodeLinks, PrefillConfig
from common.runtime.process import (HelpFormat, add_worker_args, die_with_parent, run_node, stop_event_on_signals,
                            worker_config)
from prefill_node.node import PrefillNode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefill_node", description=__doc__,
                                formatter_class=HelpFormat)
    add_worker_args(p)
    p.add_argument("--frontend", required=True, help="the frontend's node endpoint")
    p.add_argument("--name", default="prefill-0", help="unique in the cluster (with keys: its key's name)")
    p.add_argument("--token-budget", "--max-num-batched-tokens", type=int, default=8192,
                   help="prompt tokens per forward pass (a prefill node runs no decode "
                        "steps, so larger passes cost no one latency)")
    p.add_argument("--handoff-lease", type=float, default=10.0,
                   help="seconds after its prefill within which a handoff must be committed, "
                        "and within which a decode node must answer a reservation request")
    p.add_argument("--kv-transfer", choices=KV_TRANSFERS, default="auto",
                   help="auto: ipc with a decode node on this host, else tcp")
    p.add_argument("--keys", default=None, metavar="DIR",
                   help="CURVE keys (python -m launch.keys DIR); this node's is DIR/NAME.key_secret")
    p.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", action="store_true",
                   help="compute every prompt from scratch (default: reuse cached full blocks)")
    p.add_argument("--allow-remote", action="store_true", help="allow non-loopback endpoints")
    a = p.parse_args(argv)
    die_with_parent()
    stop = stop_event_on_signals()

    def build() -> PrefillNode:
        return PrefillNode(PrefillConfig(
            worker=worker_config(a), frontend_endpoint=a.frontend, name=a.name,
            token_budget=a.token_budget, handoff_lease_s=a.handoff_lease, kv_transfer=a.kv_transfer,
            links=NodeLinks(), allow_remote=a.allow_remote, keys_dir=a.keys,
            is_prefix_caching=not a.no_prefix_caching))
    return run_node("prefill_node", build, stop)


if __name__ == "__main__":
    sys.exit(main())
