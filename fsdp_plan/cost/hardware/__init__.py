"""The machine the step-time model runs on: ``Hardware``, the bundled presets (``*.yaml`` beside
this file) and hand-written or calibrated hardware files. See [Note: hardware files] in
``hardware.py``."""

from fsdp_plan.cost.hardware.hardware import (
    COLLECTIVE_KINDS,
    DTYPES,
    GPUS,
    MM_CLASSES,
    Hardware,
    hardware_for,
    hardware_yaml,
    read_hardware_file,
)

__all__ = ["COLLECTIVE_KINDS", "DTYPES", "GPUS", "MM_CLASSES", "Hardware", "hardware_for",
           "hardware_yaml", "read_hardware_file"]
