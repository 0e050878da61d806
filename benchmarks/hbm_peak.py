"""Peak HBM bandwidth of the GPU a benchmark runs on: the roofline its figures are
fractions of.

Vendor datasheet figures, matched on the device name torch reports. A GPU not in
the table needs the benchmark's `--hbm-tb-per-s`.
"""

from __future__ import annotations

import torch

# (substring of torch.cuda.get_device_name, bytes per second); the first match wins,
# so a more specific name comes before the one it contains.
PEAK_HBM_BYTES_PER_S = (
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),  # SXM5 80GB HBM3
    ("A100-SXM4-80GB", 2.039e12),
    ("MI355X", 8.0e12),
    ("MI350X", 8.0e12),
    ("MI325X", 6.0e12),
    ("MI300X", 5.3e12),
)


def peak_hbm_bytes_per_s(device_name: str) -> float | None:
    """The datasheet HBM bandwidth of `device_name`, or None if unknown."""
    return next(
        (rate for key, rate in PEAK_HBM_BYTES_PER_S if key in device_name), None
    )


def resolve_hbm_bytes_per_s(given_tb_per_s: float | None) -> float:
    """`--hbm-tb-per-s` when given, else the current CUDA device's datasheet figure."""
    if given_tb_per_s is not None:
        return given_tb_per_s * 1e12
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    rate = peak_hbm_bytes_per_s(name)
    if rate is None:
        raise SystemExit(
            f"no datasheet HBM bandwidth for {name!r}: pass --hbm-tb-per-s"
        )
    return rate
