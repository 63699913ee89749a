import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The tests import these from here; ROOT goes on sys.path first.
from launch.tools.reference import clear_prompts, hf_greedy, hf_greedy_gaps  # noqa: E402,F401

# What a test needs (pytest -m unit is the fast loop): `cluster` starts nodes, a cluster
# or another Python process; `hosts` needs root (network namespaces); `unit`, the rest,
# runs in this process. A test that asks for a fixture of CLUSTER_FIXTURES is `cluster`;
# one that starts processes otherwise says so with @pytest.mark.cluster. NOTE: a `unit`
# test that starts a Python or bash process fails (_unit_tests_start_no_process), so
# the marks stay true.
CLUSTER_FIXTURES = {"cluster", "oai", "procs", "squeezed"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("cluster") or item.get_closest_marker("hosts"):
            continue
        is_cluster = CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ()))
        item.add_marker(pytest.mark.cluster if is_cluster else pytest.mark.unit)


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request, monkeypatch):
    if request.node.get_closest_marker("unit") is None:
        return
    popen = subprocess.Popen.__init__

    def guarded(self, args, *a, **kw):
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        if argv and (
            os.path.basename(str(argv[0])) in ("bash", "sh") or str(argv[0]) == sys.executable
        ):
            raise AssertionError(f"a unit test started {argv[:3]}: mark it @pytest.mark.cluster")
        popen(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)


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
