"""The Qwen3-style DSpark draft (MiniMax-M3's drafter): `model.py`, `config.py`."""
