"""Tests against real NVIDIA GPUs (NVML); each module skips itself where none is."""

from __future__ import annotations

import pynvml
import pytest


def require_nvml() -> None:
    """Skip the calling module, with the reason, where ``nvmlInit()`` fails
    (no NVIDIA driver or GPU); call it at module level before the tests."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        why = f"no NVIDIA driver/GPU here: pynvml.nvmlInit() failed ({err})"
        pytest.skip(why, allow_module_level=True)
    else:
        pynvml.nvmlShutdown()
