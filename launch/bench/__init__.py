"""The benchmarks (`pdserve bench serving|prefill|decode|transfer|migration|vs|profile`):
each prints a JSON line with its figures, the device, and the bound it is measured
against. serving.py drives a running cluster (report.py: what one rate reports);
prefill.py, decode.py and transfer.py measure one node against this machine's
floors (common.py: shapes, floors, the transformers baseline); vs.py runs pdserve
and vLLM (or another checkout) side by side; profile.py lists a worker's top
kernels."""
