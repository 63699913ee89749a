import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The tests import these from here; ROOT goes on sys.path first.
from launch.tools.reference import (  # noqa: E402,F401
    clear_prompts,
    hf_greedy,
    hf_greedy_gaps,
    hf_greedy_logprobs,
)

# What a test needs, and the room its file is in: `unit` tests (tests/unit) run in this
# process and are the fast loop (pytest -m unit, or pytest tests/unit: the same tests);
# `cluster` tests (tests/cluster) start nodes, a cluster or another Python process, and
# `hosts` tests among them need root (network namespaces). A test's room is its mark.
# NOTE: a test in tests/unit that asks for a fixture of CLUSTER_FIXTURES or carries a
# `cluster` or `hosts` mark stops the run, naming it, and a unit test (or a fixture of its
# module) that starts a Python or bash process fails (_unit_tests_start_no_process): so a
# test that needs more cannot hide in the fast loop.
ROOMS = ("unit", "cluster")
CLUSTER_FIXTURES = {"cluster", "oai", "procs", "squeezed"}


def _room_of(path: Path) -> str | None:
    """The room a test file is in: the folder under tests/ that holds it, if one of ROOMS."""
    parts = Path(path).resolve().relative_to(ROOT / "tests").parts
    return parts[0] if len(parts) > 1 and parts[0] in ROOMS else None


def pytest_collection_modifyitems(config, items):
    misplaced = []
    for item in items:
        room = _room_of(item.path)
        needs_more = (
            item.get_closest_marker("cluster")
            or item.get_closest_marker("hosts")
            or CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ()))
        )
        if room is None or (room == "unit" and needs_more):
            misplaced.append(f"{item.nodeid} ({'cluster' if needs_more else 'unit'})")
        elif room == "unit":
            item.add_marker(pytest.mark.unit)
        elif not item.get_closest_marker("cluster"):
            item.add_marker(pytest.mark.cluster)
    if misplaced:
        raise pytest.UsageError(
            "tests outside their room (tests/unit: in this process; tests/cluster: the rest):\n"
            + "\n".join(misplaced)
        )


@pytest.fixture(scope="module", autouse=True)
def _unit_tests_start_no_process(request):
    """Module-wide, so that a module's own fixtures are held to it too."""
    if _room_of(request.path) != "unit":
        yield
        return
    popen = subprocess.Popen.__init__

    def guarded(self, args, *a, **kw):
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        if argv and (
            os.path.basename(str(argv[0])) in ("bash", "sh") or str(argv[0]) == sys.executable
        ):
            raise AssertionError(f"a unit test started {argv[:3]}: it belongs in tests/cluster")
        popen(self, args, *a, **kw)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", guarded)
        yield


@pytest.fixture(scope="session")
def make_model(tmp_path_factory):
    """make_model(**shape) -> a tiny checkpoint directory, made once per shape."""
    from launch.make_tiny_model import make_tiny_model

    made: dict[tuple, Path] = {}

    def make(**kwargs) -> Path:
        key = tuple(sorted(kwargs.items()))
        if key not in made:
            made[key] = make_tiny_model(tmp_path_factory.mktemp("model"), **kwargs)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(make_model) -> Path:
    return make_model()
