"""GPUs this host shows, counted without importing torch where there can be none (torch-free at import)."""

from __future__ import annotations

import glob


def nvidia_devices_present() -> bool:
    """Without NVIDIA device nodes torch can see no GPU: then skip its multi-second import."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def visible_gpu_count() -> int:
    if not nvidia_devices_present():
        return 0
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 (a broken driver reads as "no GPU": never crash the launcher or the doctor)
        return 0
