"""handoff: reserve -> write -> commit between a prefill node and a decode node, both halves, and the leases they share. Imports base, kv, wire, transfer."""
