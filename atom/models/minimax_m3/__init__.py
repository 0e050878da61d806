"""MiniMax-M3 / M3.1 target models (block-sparse GQA, swigluoai MoE); classes in
`model.py`."""
