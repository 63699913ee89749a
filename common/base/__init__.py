"""base: the ground floor: environment variables, logging, the role configs, the model's
spec, a request's parameters and rules. Imports nothing of ours; everything, kernels/
included, may import it."""
