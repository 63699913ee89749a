"""A client written from docs/protocol.md alone: pyzmq + msgpack, no pdserve imports."""
import msgpack
import zmq

from tests.test_cluster import cluster  # noqa: F401  (the shared cluster fixture)


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
        sock.send(msgpack.packb({"v": 1, "type": "stats"}))
        stats = _recv(sock)
        assert stats["type"] == "stats_reply" and stats["is_ready"] is True
        assert {n["role"] for n in stats["nodes"].values()} == {"prefill", "decode"}

        sock.send(msgpack.packb({"v": 1, "type": "generate", "request_id": "raw-1",
                                 "prompt": "Hello, world!", "max_tokens": 6, "ignore_eos": True}))
        tokens, text, last = [], "", None
        while last is None or not last["is_finished"]:
            last = _recv(sock)
            assert last["type"] == "output" and last["request_id"] == "raw-1"
            tokens += last["token_ids"]
            text += last["text"]
        assert last["finish_reason"] == "length" and last["error"] is None
        assert len(tokens) == 6 and last["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 6}
        assert set(last["timings"]) >= {"queue_ms", "prefill_ms", "kv_transfer_ms",
                                        "decode_admission_ms", "ttft_ms", "total_ms"}

        sock.send(msgpack.packb({"v": 1, "type": "generate", "request_id": "raw-2",
                                 "prompt": "x", "top_p": 2.0}))
        bad = _recv(sock)
        assert bad["is_finished"] and bad["finish_reason"] == "error" and "top_p" in bad["error"]
    finally:
        ctx.destroy()

