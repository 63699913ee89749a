"""Every process's flags are made from its config's fields: the defaults are the
config's own, vLLM's names set the same fields, values are parsed as documented,
and a bad value is an error before anything starts."""

from __future__ import annotations

import dataclasses

import pytest

from common.base.config import DecodeConfig, FrontendConfig, NodeLinks, PrefillConfig, WorkerConfig
from common.base.flags import flagged, flags_of
from decode_node.__main__ import parser as decode_parser
from frontend.__main__ import parser as frontend_parser
from prefill_node.__main__ import parser as prefill_parser

EP = "tcp://127.0.0.1:5601"


def _decode(*argv: str) -> DecodeConfig:
    a = decode_parser().parse_args(
        ["--shape", "qwen3-0.6b", "--frontend", EP, "--kv-bind", EP, *argv]
    )
    return DecodeConfig(worker=WorkerConfig(**flagged(WorkerConfig, a)), **flagged(DecodeConfig, a))


def _prefill(*argv: str) -> PrefillConfig:
    a = prefill_parser().parse_args(["--shape", "qwen3-0.6b", "--frontend", EP, *argv])
    return PrefillConfig(
        worker=WorkerConfig(**flagged(WorkerConfig, a)), **flagged(PrefillConfig, a)
    )


def test_the_defaults_are_the_configs_own():
    worker = WorkerConfig(shape="qwen3-0.6b")
    assert _decode() == DecodeConfig(worker=worker, frontend_endpoint=EP, kv_endpoint=EP)
    assert _prefill() == PrefillConfig(worker=worker, frontend_endpoint=EP)
    a = frontend_parser().parse_args(["--model", "m", "--clients", EP, "--nodes", EP])
    fields = flagged(FrontendConfig, a)
    assert (
        fields.pop("model") == "m"
        and fields.pop("client_endpoint") == fields.pop("node_endpoint") == EP
    )
    # An on/off flag not given leaves the field alone; every other flag carries the default.
    assert fields == {
        f.name: f.default
        for f, _ in flags_of(FrontendConfig)
        if f.default is not dataclasses.MISSING and f.type != "bool"
    }
    assert not hasattr(a, "allow_remote") and not hasattr(a, "is_client_auth")
    assert flagged(NodeLinks, a) == {"dead_after_s": NodeLinks.dead_after_s}


def test_every_flagged_field_has_a_flag_with_help_on_its_parser():
    for parser, configs in (
        (decode_parser(), (WorkerConfig, DecodeConfig)),
        (prefill_parser(), (WorkerConfig, PrefillConfig)),
        (frontend_parser(), (FrontendConfig,)),
    ):
        by_dest = {a.dest: a for a in parser._actions}
        for cls in configs:
            for f, fl in flags_of(cls):
                assert f.name in by_dest and fl.name in by_dest[f.name].option_strings and fl.help


def test_vllm_names_set_the_same_fields():
    cfg = _decode("--max-num-seqs", "8", "--enforce-eager", "--gpu-memory-utilization", "0.5")
    assert (cfg.worker.max_batch_size, cfg.worker.use_graphs, cfg.worker.kv_cache_fraction) == (
        8,
        False,
        0.5,
    )
    cfg = _prefill("--max-num-batched-tokens", "512", "--no-enable-prefix-caching")
    assert cfg.token_budget == 512 and not cfg.is_prefix_caching


def test_values_are_parsed_as_documented():
    assert _decode("--swap-space", "0.5").swap_space == 2**29  # a bare number is GiB
    assert _decode("--swap-space", "512MiB").swap_space == 2**29
    assert _decode().swap_space == 4 * 2**30
    cfg = _decode(
        "--kv-cache-memory", "2GiB", "--dtype", "auto", "--no-preemption", "--max-model-len", "512"
    )
    assert (
        cfg.worker.kv_cache_memory,
        cfg.worker.dtype,
        cfg.is_preemptive,
        cfg.worker.max_model_len,
    ) == (2 * 2**30, None, False, 512)
    assert _prefill("--handoff-lease", "2.5", "--kv-transfer", "tcp").handoff_lease_s == 2.5


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-queue", "many"],
        ["--kv-transfer", "pigeon"],
        ["--swap-space", "lots"],
        ["--frontend"],
    ],
)
def test_a_bad_value_is_an_error_before_anything_starts(argv, capsys):
    with pytest.raises(SystemExit) as e:
        decode_parser().parse_args(
            ["--shape", "qwen3-0.6b", "--frontend", EP, "--kv-bind", EP, *argv]
        )
    assert e.value.code == 2 and "error" in capsys.readouterr().err


def test_a_wildcard_kv_bind_needs_an_address_prefill_nodes_can_reach():
    with pytest.raises(ValueError, match="--kv-advertise"):
        _decode("--allow-remote", "--kv-bind", "tcp://0.0.0.0:5602")
    with pytest.raises(ValueError, match="wildcard"):
        _decode("--allow-remote", "--kv-advertise", "tcp://[::]:5602")
    cfg = _decode(
        "--allow-remote", "--kv-bind", "tcp://0.0.0.0:5602", "--kv-advertise", "tcp://10.1.2.3:5602"
    )
    assert cfg.kv_endpoint == "tcp://0.0.0.0:5602" and cfg.kv_reachable == "tcp://10.1.2.3:5602"
    assert _decode().kv_reachable == EP
