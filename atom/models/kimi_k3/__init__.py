"""Kimi Linear / Kimi-K3 / K3.1 target models (kimi_k3.md); classes in `model.py`."""
