"""The Ray controller's keys on a one-machine Ray: a member Ray is starting again gets them
once it answers (on fake actors: tests/unit/test_ray_members.py)."""

from __future__ import annotations

import shutil

import pytest

ray = pytest.importorskip("ray")

from launch.ray import keys as ray_keys  # noqa: E402


@pytest.mark.cluster
def test_keys_reach_a_member_ray_is_starting_again_on_a_real_ray(tmp_path, monkeypatch):
    """On a one-machine Ray: a member whose process exited, and that Ray takes a while to
    start again, is given the keys once it answers; nothing raises."""
    import os
    import time
    from pathlib import Path

    @ray.remote(max_restarts=-1, max_task_retries=0, num_cpus=0)
    class Restarting:
        def __init__(self, marker: str):
            if os.path.exists(marker):
                time.sleep(3)  # its second start takes a while
            Path(marker).touch()
            self.keys = None

        def write_keys(self, public):
            self.keys = public

        def read(self):
            return self.keys

        def exit(self):
            os._exit(1)

    temp = Path("/tmp") / f"pdsray-{os.getpid()}"  # NOTE: Ray's socket paths must stay short
    # NOTE: else ray.init makes a token in ~/.ray, which every later `ray start` here then wants
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _temp_dir=str(temp))
    try:
        member = Restarting.remote(str(tmp_path / "started"))
        assert ray.get(member.read.remote(), timeout=120) is None
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(member.exit.remote(), timeout=60)
        lines = []
        missed = ray_keys.send_keys(
            {"prefill-0": member},
            {"prefill-0": "prefill"},
            ["decode-1"],
            "decode",
            {"decode-1.key": b"k"},
            lambda n: False,
            60,
            lines.append,
        )
        assert missed == [] and ray.get(member.read.remote(), timeout=60) == {"decode-1.key": b"k"}
        assert lines and "prefill-0 is being started again by Ray; giving it the new" in lines[0]
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
