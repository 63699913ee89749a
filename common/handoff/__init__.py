"""The KV handoff, both halves: reserve -> write -> commit. Imports base, kv, wire, transfer.

    prefill node (sender.py)                  decode node (receiver.py)
    Sender.begin(job)          --KVReserve-->  Receiver: blocks, a place in line, or no
                               <--KVReserved-  (granted later unasked from the line)
    start_writes(jobs)         ====KV====>     sink lands tcp frames / dist receives
    advance(): written -> local blocks freed
    set_first_token(job, t)    --KVCommit--->  checked, waits for a batch row
                               <-HandoffAck--  next_ready() hands it to the batch

The sender's asks and their answers are asks.py's, its peers' restarts and resets
peer_events.py's; the receiver's answers are reservations.py's, its KV landing and
commits landing.py's. Each side's state is one enum (states.py: Stage, Hold, with the transitions);
both count the reservation's lease with lease.Lease. Time comes from a clock and messages
through a link the caller passes in, so both halves run in a test with a fake
clock and an in-memory link (tests/unit/test_handoff_states.py).
"""
