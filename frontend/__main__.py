"""python -m frontend --model DIR --clients tcp://127.0.0.1:5600 --nodes tcp://127.0.0.1:5601"""

if __name__ == "__main__":
    # NOTE: first, before the imports below (torch: seconds): a launcher that dies during
    # them takes this process too
    from common.base.lifetime import die_with_parent

    die_with_parent("frontend")


import argparse
import asyncio
import shutil
import sys
from pathlib import Path

from common.base.config import FrontendConfig, NodeLinks
from common.base.env import read_env
from common.base.flags import add_flags, flagged
from common.base.log import add_log_level_arg, get_logger, set_level, set_name
from common.runtime.process import HelpFormat, add_thread_args, apply_threads
from common.wire.channel import LinkError
from frontend.access_log import set_access_log
from frontend.server import Frontend


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m frontend", description=__doc__, formatter_class=HelpFormat
    )
    add_flags(p, FrontendConfig)
    add_flags(p, NodeLinks, only=("dead_after_s",))
    add_thread_args(p)
    add_log_level_arg(p)
    p.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="log each HTTP request as it ends: client, request line, status, time",
    )
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    set_level(a.log_level)
    set_name("frontend")
    set_access_log(a.access_log)
    try:
        apply_threads(a.threads, a.cpus, is_host_device=False)  # no device: one thread unless told
        cfg = FrontendConfig(links=NodeLinks(**flagged(NodeLinks, a)), **flagged(FrontendConfig, a))
        frontend = Frontend(cfg)
    except ValueError as e:
        print(f"frontend: {e}", file=sys.stderr)
        return 2
    try:
        try:
            import uvloop

            rc = uvloop.run(frontend.run())
        except ImportError:
            rc = asyncio.run(frontend.run())
        get_logger("frontend").info("stopped")
        return rc
    except LinkError as e:
        print(f"frontend: {e}", file=sys.stderr)
        return 1
    finally:
        remove_temp_keys(cfg.keys_dir)


def remove_temp_keys(keys_dir: str | None) -> None:
    """Keys its launcher made for this cluster alone go with the frontend, secret keys
    first of all: also when the launcher was killed and cannot remove them."""
    temp = read_env().temp_keys
    if temp is not None and keys_dir is not None and temp.resolve() == Path(keys_dir).resolve():
        shutil.rmtree(temp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
