"""Memory a device has free, so a model too large for it is refused before anything is allocated."""
from __future__ import annotations

import os

import torch


def available_bytes(device: torch.device | str = "cpu") -> int | None:
    """Free bytes: on CUDA from the driver (torch.cuda.mem_get_info); on the CPU the memory the
    kernel could give without swapping (psutil's available, else /proc/meminfo's MemAvailable,
    else the physical pages os.sysconf counts). None where nothing says."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] if torch.cuda.is_available() else None
    if device.type != "cpu":
        return None
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def describe_bytes(n: float) -> str:
    """12345678 -> '11.8 MiB'."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        n /= 1024
        if n < 1024 or unit == "EiB":
            break
    return f"{n:.1f} {unit}"
