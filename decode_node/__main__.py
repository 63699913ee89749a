"""The decode node's command line:

python -m decode_node --frontend tcp://127.0.0.1:5601 --kv-bind tcp://127.0.0.1:5602 --model DIR
"""

if __name__ == "__main__":
    # NOTE: first, before the imports below (torch: seconds): a launcher that dies during
    # them takes this process too
    from common.base.lifetime import die_with_parent

    die_with_parent("decode_node")


import argparse
import dataclasses
import sys

from common import transfer
from common.base.config import DecodeConfig, is_loopback_endpoint
from common.base.flags import add_flags, flagged
from common.engine.platform import check_device, platform_type, torch_device
from common.runtime.process import (
    HelpFormat,
    add_worker_args,
    run_node,
    stop_event_on_signals,
    worker_config,
)
from decode_node.node import DecodeNode


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m decode_node", description=__doc__, formatter_class=HelpFormat
    )
    add_worker_args(p)
    add_flags(p, DecodeConfig, more_help={"kv_transfer": transfer.availability()})
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    stop = stop_event_on_signals()

    def build() -> DecodeNode:
        # A backend may need the cache where other processes map it (ipc on CPU: shared memory).
        check_device(a.device)  # its platform says whether this machine has it
        worker = worker_config(a, platform_type(a.device).is_host)
        device, reachable = torch_device(worker.device), a.kv_advertise or a.kv_endpoint
        platform = platform_type(device)
        is_row_exact = platform.is_row_exact(worker.torch_dtype or platform.default_dtype)
        transfer.check_usable(a.kv_transfer, device)
        worker = dataclasses.replace(
            worker,
            is_cache_in_shm=transfer.needs_shared_cache(
                a.kv_transfer, device, not is_loopback_endpoint(reachable)
            ),
            # auto (the default) becomes what a decode node on this device runs
            speculative=worker.speculative.for_decode_node(platform.is_host, is_row_exact),
        )
        return DecodeNode(DecodeConfig(worker=worker, **flagged(DecodeConfig, a)))

    return run_node("decode_node", build, stop)


if __name__ == "__main__":
    sys.exit(main())
