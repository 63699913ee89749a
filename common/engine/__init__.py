"""engine: the device platform, the model, its loader, sampling and the device worker.
Imports base, kv, kernels; knows no transport."""
