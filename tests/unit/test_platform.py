"""A device is one platform class (common/engine/platform.py): a test adds a stand-in
device from within itself, touching no other file, and a worker serves on it with
transformers' own tokens; the process set-up checks it, and the kernels are told of
its module."""

from __future__ import annotations

import threading

import pytest
import torch

from common.base.config import WorkerConfig
from common.base.request import SamplingParams
from common.engine import platform, platform_cpu
from common.engine.worker import DeviceWorker
from kernels import options
from launch.tools.offline import generate
from tests.conftest import hf_greedy


@pytest.fixture
def standin(monkeypatch):
    """A device type "standin" whose memory is the host's: everything it declares is its own."""
    monkeypatch.setattr(platform, "PLATFORMS", dict(platform.PLATFORMS))
    checked = []

    @platform.register
    class StandIn(platform.CpuPlatform):
        type = "standin"
        kernels = "kernels.portable"  # its kernels module: any module with the ops
        kernels_off = None
        default_dtype = torch.float32

        @classmethod
        def torch_device(cls, name: str) -> torch.device:
            return torch.device("cpu")

        @classmethod
        def check(cls, device: torch.device) -> None:
            checked.append(device)

    yield StandIn, checked
    monkeypatch.undo()
    platform.configure_kernels()  # the options as the real platforms say


def test_a_stand_in_device_serves_with_transformers_tokens(standin, tiny_model):
    cls, checked = standin
    platform.check_device("standin:0")
    assert checked == [torch.device("cpu")]
    prompts = [[5, 17, 99, 3, 250], [7] * 20]
    with DeviceWorker(
        WorkerConfig(model=str(tiny_model), device="standin:0", kv_cache_memory=2**20)
    ) as w:
        assert isinstance(w.platform, cls) and w.dtype == torch.float32
        got = [
            r["token_ids"]
            for r in generate(w, prompts, [SamplingParams(max_tokens=8, ignore_eos=True)] * 2)
        ]
    assert got == hf_greedy(tiny_model, prompts, 8)
    assert ("standin", "kernels.portable") in options.current[0].fast  # its kernels, as it declared


def test_an_unknown_device_type_names_the_ones_there_are():
    with pytest.raises(ValueError, match="cpu, cuda, npu"):
        platform.check_device("tpu:0")


def test_a_device_that_leaves_out_what_a_device_must_define_is_refused():
    """A new device declares and defines everything itself: nothing is inherited from
    another device, so a half-written one fails at once, naming what it lacks."""
    from common.engine.platform_base import Platform

    with pytest.raises(TypeError, match="does not declare .*is_pinned"):

        class Undeclared(Platform):  # noqa: F841 (the class statement is what fails)
            type = "half"
            kernels = kernels_off = nixl_memory = None
            is_host = True
            default_dtype = torch.float32
            can_capture_graphs = False

    class Declared(Platform):
        type = "half"
        kernels = kernels_off = nixl_memory = None
        is_host = is_pinned = True
        default_dtype = torch.float32
        can_capture_graphs = False

    with pytest.raises(TypeError, match="abstract"):
        Declared(torch.device("cpu"))
    assert not issubclass(platform.CudaPlatform, platform.CpuPlatform)
    assert not issubclass(platform.NpuPlatform, platform.CpuPlatform)


def _resident_kib(name: str) -> list[int]:
    """Rss of each of this process's mappings of /dev/shm/<name>, from /proc/self/smaps."""
    sizes, is_it = [], False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:  # a mapping's first line
                is_it = line.rstrip().endswith(f"/dev/shm/{name}")
            elif is_it and line.startswith("Rss:"):
                sizes.append(int(line.split()[1]))
    return sizes


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MAP_POPULATE"), reason="Linux only")
def test_a_shared_cpu_cache_is_in_memory_in_both_processes_before_any_write():
    """A shared cache's pages were allocated at their first touch, and mapped in the prefill
    process at its first write to each: a third of its loop's time went to page faults
    inside KV writes. The pages are had at allocation, the peer's mapping made whole."""
    import os

    cpu = platform.platform_for("cpu")
    shape, num_kib = [2, 2, 64, 16, 2, 32], 2 * 2 * 64 * 16 * 2 * 32 * 2 // 1024
    cache = cpu.allocate(shape, torch.bfloat16, is_shared=True)
    try:
        name = cpu.share(cache)  # its pages had, and this process's mapping whole
        assert os.stat(f"/dev/shm/{name}").st_blocks * 512 >= num_kib * 1024
        assert num_kib in _resident_kib(name) and not cache.any()
        peer, close = cpu.open_shared(name, torch.bfloat16, shape)
        assert _resident_kib(name).count(num_kib) == 2  # and the peer's
        peer[1, 0, 3] = 1.5
        assert cache[1, 0, 3].eq(1.5).all()
        del peer
        close()
    finally:
        del cache
        cpu.release()


def test_a_shared_cache_dev_shm_cannot_hold_is_refused_in_one_line(monkeypatch):
    """Where /dev/shm was smaller than the cache (a container's 64 MiB), the node started
    and a KV write past its end killed the writer with SIGBUS; zeroing it at start killed
    the decode node with a bare "Bus error". It is refused, naming the fixes, and no
    segment is left behind."""
    import errno
    import os

    cpu = platform.platform_for("cpu")

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(ValueError, match="--kv-cache-memory less.*--shm-size.*--kv-transfer tcp"):
        cpu.allocate([2, 2, 64, 16, 2, 32], torch.bfloat16, is_shared=True)
    assert set(os.listdir("/dev/shm")) <= before and cpu._segment is None


def _is_mapped(name: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(f"/dev/shm/{name}" in line for line in f)


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MAP_POPULATE"), reason="Linux only")
def test_a_shared_cache_released_under_a_live_tensor_stays_mapped_until_it_goes():
    """release() and a peer's close() unmapped the pages under a tensor still alive (torch
    holds no export of what it wraps): its next read was a SIGSEGV. The pages now stay
    mapped while any view of them lives, and go with the last. NOTE: the mapping is
    looked up before any view is touched, so a regression fails here, not in a crash."""
    import gc
    import os

    cpu = platform.platform_for("cpu")
    cache = cpu.allocate([4, 256], torch.float32, is_shared=True)
    name = cpu.share(cache)
    peer, close = cpu.open_shared(name, torch.float32, [4, 256])
    view = cache[1]
    peer[1, 7] = 3.0
    close()
    cpu.release()
    del cache
    gc.collect()
    assert not os.path.exists(f"/dev/shm/{name}")  # unlinked at release, as before
    assert _is_mapped(name), "release() unmapped the pages under a live view"
    view[8] = 4.0
    assert (float(view[7]), float(view[8]), float(peer[1, 8])) == (3.0, 4.0, 4.0)
    del view, peer, close
    gc.collect()
    assert not _is_mapped(name)  # the pages went with the last view


def _mapping_of(address: int) -> dict | None:
    """The /proc/self/smaps entry holding address: its fields, and its VmFlags as a set."""
    entry = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                entry = {} if start <= address < end else None
            elif entry is not None:
                key, _, value = line.partition(":")
                entry[key] = set(value.split()) if key == "VmFlags" else value.strip()
                if key == "VmFlags":
                    return entry
    return None


@pytest.mark.skipif(
    platform_cpu.huge_page_zeros(platform_cpu.HUGE_PAGE) is None,
    reason="this kernel gives no huge pages on request (not Linux, or the setting `never`)",
)
def test_host_weights_and_cache_are_held_in_memory_advised_huge_pages():
    """A decode step streams every weight; over 4 KiB pages it walked the page tables every
    4 KiB of it. A weight of 2 MiB or more is copied, the same values, to a 2 MiB boundary
    in a mapping advised huge pages (VmFlags hg), had before any step; so is a cache of
    the node's own, zeroed. A smaller tensor, a view and oneDNN's own layout stay as they
    are; and the pages go with the last view."""
    import gc

    cpu = platform.platform_for("cpu")
    weight = torch.randn(1536, 1024).bfloat16()  # 3 MiB
    held = cpu.hold(weight)
    assert torch.equal(held, weight) and held.data_ptr() != weight.data_ptr()
    assert held.data_ptr() % platform_cpu.HUGE_PAGE == 0 and held.is_contiguous()
    mapping = _mapping_of(held.data_ptr())
    assert "hg" in mapping["VmFlags"]
    assert int(mapping["Rss"].split()[0]) * 1024 >= 3 << 20  # had now, not at a first touch
    small, strided = torch.randn(64, 64), weight.t()
    assert cpu.hold(small) is small and cpu.hold(strided) is strided
    if torch.backends.mkldnn.is_available():
        packed = torch.randn(1536, 1024).to_mkldnn()
        assert cpu.hold(packed) is packed
    cache = cpu.allocate([2, 2, 64, 16, 2, 128], torch.bfloat16)
    assert cache.shape == (2, 2, 64, 16, 2, 128) and not cache.any()
    assert "hg" in _mapping_of(cache.data_ptr())["VmFlags"]
    address = held.data_ptr()
    del held, cache
    gc.collect()
    assert _mapping_of(address) is None


@pytest.mark.skipif(
    platform_cpu.huge_page_zeros(platform_cpu.HUGE_PAGE) is None,
    reason="this kernel gives no huge pages on request (not Linux, or the setting `never`)",
)
def test_a_host_worker_holds_its_tied_table_once_in_huge_pages_with_transformers_tokens(
    make_model,
):
    """prepare() holds every weight (a tied table of 4 MiB here; the layers' matrices are
    too small to be held) and its KV cache in huge pages: the table is still the lm_head
    itself, not a second copy, and the tokens are transformers' own."""
    model = make_model(vocab_size=8192, hidden_size=128)
    prompts = [[5, 17, 99, 3, 250], [7000] * 20]
    with DeviceWorker(WorkerConfig(model=str(model), device="cpu", kv_cache_memory=8 << 20)) as w:
        table = w.weights.embed
        assert w.weights.lm_head is table and table.shape == (8192, 128)
        assert table.data_ptr() % platform_cpu.HUGE_PAGE == 0
        assert "hg" in _mapping_of(table.data_ptr())["VmFlags"]
        assert "hg" in _mapping_of(w.kv_cache.data_ptr())["VmFlags"]
        qkv = w.weights.layers[0].qkv
        assert qkv.numel() * qkv.element_size() < platform_cpu.HUGE_PAGE
        assert "hg" not in (_mapping_of(qkv.data_ptr()) or {}).get("VmFlags", set())
        got = [
            r["token_ids"]
            for r in generate(w, prompts, [SamplingParams(max_tokens=8, ignore_eos=True)] * 2)
        ]
    assert got == hf_greedy(model, prompts, 8)


def test_a_host_worker_hands_back_what_its_weights_were_copied_from(monkeypatch, tiny_model):
    """The weights' first copies, freed once held in huge pages, stayed in the C heap: a
    0.6B node kept ~0.84 GB more resident. prepare() hands them back after holding the
    weights, and the CPU's release_memory() is glibc's malloc_trim."""
    from common.engine import qwen3

    order = []
    hold_matrices = qwen3.hold_matrices
    monkeypatch.setattr(
        qwen3, "hold_matrices", lambda *a: order.append("hold") or hold_matrices(*a)
    )
    monkeypatch.setattr(
        platform_cpu.CpuPlatform, "release_memory", lambda self: order.append("release")
    )
    with DeviceWorker(WorkerConfig(model=str(tiny_model), device="cpu", kv_cache_memory=2**20)):
        assert order[:2] == ["hold", "release"]
    monkeypatch.undo()
    if __import__("platform").libc_ver()[0] == "glibc":
        assert platform_cpu._malloc_trim() is not None
    trims = []
    monkeypatch.setattr(platform_cpu, "_malloc_trim", lambda: trims.append)
    platform.platform_for("cpu").release_memory()
    assert trims == [0]


def test_a_host_worker_loads_on_a_thread_of_its_own_and_its_errors_reach_the_caller(
    monkeypatch, tiny_model
):
    """The load runs on a thread that ends (the OpenMP pool it starts ends with it, not kept
    beside each pass's), with the caller's torch threads; its error is the caller's."""
    from common.engine import loader

    seen = []
    load_model = loader.load_model

    def spy(*a):
        seen.append((threading.current_thread(), torch.get_num_threads()))
        return load_model(*a)

    monkeypatch.setattr(loader, "load_model", spy)
    before = torch.get_num_threads()
    # NOTE: a new thread takes the threads last set anywhere: a lane's one, say
    torch.set_num_threads(2)
    lane = threading.Thread(target=torch.set_num_threads, args=(1,))
    lane.start()
    lane.join()
    cfg = WorkerConfig(model=str(tiny_model), device="cpu", kv_cache_memory=2**20)
    try:
        with DeviceWorker(cfg):
            [(thread, num_threads)] = seen
            assert thread is not threading.current_thread() and not thread.is_alive()
            assert num_threads == 2  # the caller's
    finally:
        torch.set_num_threads(before)
    monkeypatch.setattr(loader, "load_model", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        DeviceWorker(cfg).prepare()
