"""Kimi Linear / Kimi-K3 / K3.1 target models (docs/kimi_k3.md): the classes in
`model.py`, and their DSpark draft (K3DSparkModel) in `dspark.py`."""
