"""A client written from docs/protocol.md alone: pyzmq + msgpack, no pdserve imports."""

import msgpack
import zmq

from tests.cluster.test_cluster import cluster  # noqa: F401  (the shared cluster fixture)


def _recv(sock):
    assert sock.poll(10_000), "no reply within 10s"
    return msgpack.unpackb(sock.recv(), raw=False)


def test_raw_pyzmq_msgpack_client(cluster, tiny_model):  # noqa: F811
    from transformers import AutoTokenizer

    prompt_len = len(AutoTokenizer.from_pretrained(str(tiny_model)).encode("Hello, world!"))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cluster.endpoint)
    try:
        sock.send(msgpack.packb({"v": 2, "type": "stats"}))
        stats = _recv(sock)
        assert stats["type"] == "stats_reply" and stats["is_ready"] is True
        assert {n["role"] for n in stats["nodes"].values()} == {"prefill", "decode"}

        sock.send(
            msgpack.packb(
                {
                    "v": 2,
                    "type": "generate",
                    "request_id": "raw-1",
                    "prompt": "Hello, world!",
                    "max_tokens": 6,
                    "ignore_eos": True,
                }
            )
        )
        tokens, text, last = [], "", None
        while last is None or not last["is_finished"]:
            last = _recv(sock)
            assert last["type"] == "output" and last["request_id"] == "raw-1"
            tokens += last["token_ids"]
            text += last["text"]
        assert last["finish_reason"] == "length" and last["error"] is None
        assert len(tokens) == 6 and last["usage"] == {
            "prompt_tokens": prompt_len,
            "completion_tokens": 6,
            "cached_tokens": 0,
        }
        assert set(last["timings"]) >= {
            "queue_ms",
            "prefill_ms",
            "kv_transfer_ms",
            "decode_admission_ms",
            "ttft_ms",
            "total_ms",
        }

        # Requests decoded in the same steps: their outputs come to this client as `outputs`.
        for i in range(8):
            sock.send(
                msgpack.packb(
                    {
                        "v": 2,
                        "type": "generate",
                        "request_id": f"many-{i}",
                        "prompt": f"Hello {i}",
                        "max_tokens": 32,
                        "ignore_eos": True,
                    }
                )
            )
        streams, num_batches = {f"many-{i}": [] for i in range(8)}, 0
        while any(not s or not s[-1]["is_finished"] for s in streams.values()):
            msg = _recv(sock)
            if msg["type"] == "outputs":
                num_batches += 1
                assert len(msg["outputs"]) >= 2 and all("type" not in o for o in msg["outputs"])
            else:
                assert msg["type"] == "output"
            for out in msg["outputs"] if msg["type"] == "outputs" else [msg]:
                streams[out["request_id"]].append(out)
        assert num_batches > 0
        for outs in streams.values():
            assert (
                sum(len(o["token_ids"]) for o in outs) == 32
                and outs[-1]["finish_reason"] == "length"
            )
            assert [o["is_finished"] for o in outs] == [False] * (len(outs) - 1) + [True]

        sock.send(
            msgpack.packb(
                {"v": 2, "type": "generate", "request_id": "raw-2", "prompt": "x", "top_p": 2.0}
            )
        )
        bad = _recv(sock)
        assert bad["is_finished"] and bad["finish_reason"] == "error" and "top_p" in bad["error"]
    finally:
        ctx.destroy()
