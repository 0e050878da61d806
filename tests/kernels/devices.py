"""Where the kernel tests run: the CPU (Triton's interpreter) and, when present, CUDA."""

import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# (device, dtype): fp32 everywhere, bf16 where the kernels run natively.
FLOAT_CASES = [
    (device, dtype)
    for device in DEVICES
    for dtype in [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])
]


def half_dtype(device):
    # Triton 3.9's interpreter computes bf16 tl.dot wrong (fp16 is right): the
    # half-precision path is tested in fp16 on CPU, in bf16 on a GPU.
    return torch.bfloat16 if device == "cuda" else torch.float16
