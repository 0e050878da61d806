"""MiniMax-M3 / M3.1 target models (block-sparse GQA, swigluoai MoE): the classes in
`model.py`, and their Qwen3-style DSpark draft (Qwen3DSparkModel) in `dspark.py`."""
