"""Byte sizes at the edges: parse ``--mem`` values and print both decimal and binary units.

Inside the package every memory figure is an ``int`` number of bytes.
"""

from __future__ import annotations

import re
from decimal import Decimal

from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.limits import MAX_BYTES

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str | int, what: str = "--mem", *, allow_zero: bool = False) -> int:
    """``70GB`` -> 70*10**9, ``70GiB`` -> 70*2**30, ``70000MB``, or plain bytes.

    Must be > 0, or >= 0 with ``allow_zero`` (``--headroom 0`` plans right up to the limit)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _SIZE_RE.match(str(text))
        unit = match.group(2).lower() if match else ""
        if not match or unit not in _UNITS:
            raise BadInput(
                f"{what} {text!r} is not a memory size: write a positive number with an optional "
                "unit, e.g. 70GB (10^9 bytes), 70GiB (2^30 bytes), 70000MB or 75161927680."
            )
        # Exact decimal arithmetic: float("4.35") * 10**9 is 4349999999.999999.
        number = Decimal(match.group(1))
        if number.adjusted() > 30:  # 1e999999999: too large, and never expanded into digits
            value = MAX_BYTES + 1
        else:
            value = 0 if number.adjusted() < -30 else int(number * _UNITS[unit])
    if value < 0 or (value == 0 and not allow_zero):
        raise BadInput(f"{what} {text!r} must be larger than zero bytes, e.g. 80GB.")
    if value > MAX_BYTES:
        raise BadInput(f"{what} {text!r} is more than any GPU holds ({format_bytes(MAX_BYTES)}); "
                       "give the memory of ONE GPU, e.g. 80GB.")
    return value


def parse_share_of(text: str | int, total: int, what: str = "--headroom") -> int:
    """``10%`` of ``total`` in bytes, or a size as ``parse_bytes`` reads it (zero allowed)."""
    if isinstance(text, str) and text.strip().endswith("%"):
        number = text.strip()[:-1].strip()
        try:
            share = Decimal(number)
        except ArithmeticError:
            share = None
        if share is None or not share.is_finite() or not 0 <= share < 100:
            raise BadInput(f"{what} {text!r} is not a share of the budget from 0% up to (not "
                           "including) 100%, e.g. 10%.")
        return int(total * share / 100)
    return parse_bytes(text, what, allow_zero=True)


def format_bytes(num_bytes: float) -> str:
    """``61234567890`` -> ``61.23 GB (57.03 GiB)``: both units, as the report promises."""
    n = float(num_bytes)
    for dec, bin_, name, bname in ((1e12, 2**40, "TB", "TiB"), (1e9, 2**30, "GB", "GiB"),
                                   (1e6, 2**20, "MB", "MiB"), (1e3, 2**10, "kB", "KiB")):
        if abs(n) >= dec:
            return f"{n / dec:.2f} {name} ({n / bin_:.2f} {bname})"
    return f"{int(n)} B"


def format_gb(num_bytes: float) -> str:
    """Compact decimal GB for table cells; below 0.01 GB in MB, kB or B with the unit written
    (a small model's figures would all read 0.00)."""
    n = float(num_bytes)
    if n == 0 or abs(n) >= 1e7:
        return f"{n / 1e9:.2f}"
    if abs(n) >= 1e4:
        return f"{n / 1e6:.2f} MB"
    return f"{n / 1e3:.2f} kB" if abs(n) >= 1e3 else f"{int(n)} B"
