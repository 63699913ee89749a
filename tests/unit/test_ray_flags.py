"""`--ray` and its flags, read apart from the launcher's (Ray itself: tests/cluster/test_ray.py)."""

from __future__ import annotations

import pytest

from launch.cluster.plan import PlanError
from launch.ray import cluster as ray_cluster


def test_ray_flags_are_read_apart_from_the_launchers():
    ours, rest = ray_cluster.split_args(["--ray", "--num-decode", "2", "--ray-cpus-per-node", "2"])
    assert ours == {"address": "auto", "num_cpus": "2", "ship_model": False} and rest == [
        "--num-decode",
        "2",
    ]
    ours, rest = ray_cluster.split_args(["--model", "M", "--ray", "10.0.0.1:6379"])
    assert ours["address"] == "10.0.0.1:6379" and rest == ["--model", "M"]
    with pytest.raises(PlanError, match="whole number"):
        ray_cluster.split_args(["--ray", "--ray-cpus-per-node", "0"])
