"""What pdserve's processes share, in rooms. Imports run only down this list, and
a room imports only the rooms it names (tests/unit/test_layout.py checks it):

    base      environment variables, logging, the role configs, the model's
              spec, a request's parameters and rules              (nothing of ours)
    (kernels/ sits below them all: device ops; imports nothing of ours)
    kv        the cache layout, block allocator, prefix cache,
              a sequence's host-side state                        base
    wire      messages by link, their codec, channels, keys       base
    engine    device platform, model, loader, sampling, worker    base, kv, kernels
    transfer  KV transfer backends (int8 on the wire: kernels)   base, kv, wire, engine,
                                                                  kernels
    handoff   reserve -> write -> commit, both halves             base, kv, wire, transfer
    runtime   a node process: frontend link, heartbeat, threads   base, wire
"""
