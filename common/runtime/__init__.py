"""runtime: what a node process is beyond its loop: the frontend link, registration,
heartbeat, threads and signals. Imports base, wire."""
