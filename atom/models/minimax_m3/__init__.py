"""MiniMax-M3 / M3.1 target models (block-sparse GQA, swigluoai MoE): the classes in
`model.py`; their Qwen3-style DSpark draft lives in `models/qwen3_dspark/`."""
