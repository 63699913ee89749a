"""Make a cluster's CURVE keys:
python -m launch.keys DIR [--nodes prefill-0,decode-0] [--clients alice]

Writes DIR/frontend.key(_secret) and one pair per node name (and per client,
under DIR/clients/); pairs already there are kept, so a node added later takes
`python -m launch.keys DIR --nodes prefill-3` and joins a running cluster.
Secret files are readable by their owner only. Give the directory to every
process: `--keys DIR` on the frontend and on each node."""

from __future__ import annotations

import argparse
import sys

from common.runtime.process import HelpFormat
from common.wire.keys import make_keys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pdserve keys", description=__doc__, formatter_class=HelpFormat
    )
    p.add_argument("dir", help="the key directory (made if missing)")
    p.add_argument("--nodes", default="prefill-0,decode-0", help="node names, comma-separated")
    p.add_argument(
        "--clients", default="", help="client names, comma-separated (for --client-keys)"
    )
    a = p.parse_args(argv)
    try:
        made = make_keys(
            a.dir, [n for n in a.nodes.split(",") if n], [c for c in a.clients.split(",") if c]
        )
    except (ValueError, OSError) as e:
        print(f"launch.keys: {e}", file=sys.stderr)
        return 2
    for path in made:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
