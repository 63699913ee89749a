"""The benchmarks (`pdserve bench serving|prefill|decode|transfer|migration|vs|profile`):
each prints a JSON line with its figures, the device, and the bound it is measured
against. serving.py drives a running cluster (load.py: the requests and their arrivals;
report.py: what one rate reports); prefill.py, decode.py and transfer.py measure one node
against this machine's floors (common.py: shapes, floors, the transformers baseline;
node_under_test.py: the stand-in frontend that starts the node; prefill_side.py: this
process as the prefill side of a handoff; link_floors.py: the links' floors); vs.py runs
pdserve and vLLM (or another checkout) side by side (servers.py: starting and stopping
each); profile.py lists a worker's top kernels."""
