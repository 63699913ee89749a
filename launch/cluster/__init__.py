"""One host's cluster, without Ray: plan.py (the options, and which process starts with what),
preflight.py (the checks before any process starts), supervisor.py (the processes started,
restarted and stopped), leftovers.py (what killed launchers left), default_model.py and
memory_check.py (a model to serve, and whether this host can hold it), run.py (a cluster
for the length of a with-block). It imports only the processes' own packages; launch/ray/,
the tools, the benchmarks and the entry points import it."""
