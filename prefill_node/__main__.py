"""python -m prefill_node --frontend tcp://127.0.0.1:5601 --model DIR

The frontend names the decode node of each request; this node connects to
that decode node's KV link on first use."""

if __name__ == "__main__":
    # NOTE: first, before the imports below (torch: seconds): a launcher that dies during
    # them takes this process too
    from common.base.lifetime import die_with_parent

    die_with_parent("prefill_node")


import argparse
import sys

from common import transfer
from common.base.config import PrefillConfig
from common.base.flags import add_flags, flagged
from common.engine.platform import check_device, platform_type, torch_device
from common.runtime.process import (
    HelpFormat,
    add_worker_args,
    run_node,
    stop_event_on_signals,
    worker_config,
)
from prefill_node.node import PrefillNode


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prefill_node", description=__doc__, formatter_class=HelpFormat
    )
    add_worker_args(p)
    add_flags(p, PrefillConfig, more_help={"kv_transfer": transfer.availability()})
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    stop = stop_event_on_signals()

    def build() -> PrefillNode:
        check_device(a.device)  # its platform says whether this machine has it
        worker = worker_config(a, platform_type(a.device).is_host)
        transfer.check_usable(a.kv_transfer, torch_device(worker.device))
        return PrefillNode(PrefillConfig(worker=worker, **flagged(PrefillConfig, a)))

    return run_node("prefill_node", build, stop)


if __name__ == "__main__":
    sys.exit(main())
