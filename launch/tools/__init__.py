"""Tools the tests share with operators: reference.py (transformers' own tokens and
logits for a prompt), netns.py (simulated hosts in network namespaces, root only),
soak.py (a cluster under mixed load, checked token for token)."""
