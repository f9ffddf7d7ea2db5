"""Sizes given on the command line ("5GB", "512MiB"): one parser, one convention, for every option that takes a size.

The convention is Hugging Face's (and the SI/IEC one): KB, MB, GB, TB are powers of 1000; KiB, MiB, GiB, TiB are
powers of 1024; a bare number is bytes. K, M, G, T alone mean the same as KB, MB, GB, TB.
"""

from __future__ import annotations

import re

from opentau_cli.errors import UserError

# For the --help of every option that takes a size.
SIZE_HELP = "GB/MB/KB = 1000^n bytes, GiB/MiB/KiB = 1024^n bytes"

_FACTORS = {
    "": 1, "B": 1,
    "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9, "T": 10**12, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")


def parse_size(text: str, option: str) -> int:
    """'5GB' -> 5_000_000_000, '2GiB' -> 2 * 2**30, '1000' -> 1000. `option` names the flag in the error message."""
    m = _SIZE.fullmatch(str(text))
    unit = m.group(2).upper() if m else None
    if unit not in _FACTORS:
        raise UserError(f"{option} '{text}' is not a size; write e.g. 5GB ({SIZE_HELP}).")
    size = int(float(m.group(1)) * _FACTORS[unit])
    if size <= 0:
        raise UserError(f"{option} must be a positive size, got '{text}'.")
    return size



# For --gpu-memory's --help: how a card's size is read.
CARD_SIZE_HELP = ("the card's size as sold: 80GB and 80GiB both mean a card sold as 80 GB, which nvidia-smi shows as "
                  "81920 MiB (GB and TB are read as GiB and TiB here); MiB gives nvidia-smi's exact figure")


def parse_card_size(text: str, option: str) -> int:
    """A GPU's memory as its card is sold: GB (and G, TB, T) are read as GiB (TiB), since a card sold as "80GB" has
    80 GiB, what nvidia-smi and torch's total_memory report; MiB, KiB and bytes as `parse_size` reads them."""
    m = _SIZE.fullmatch(str(text))
    unit = m.group(2).upper() if m else None
    binary = {"G": "GIB", "GB": "GIB", "T": "TIB", "TB": "TIB"}.get(unit, unit)
    if binary not in ("GIB", "TIB", "MIB", "KIB", "B", ""):
        raise UserError(f"{option} '{text}' is not a card size; write e.g. 80GB ({CARD_SIZE_HELP}).")
    size = int(float(m.group(1)) * _FACTORS[binary])
    if size <= 0:
        raise UserError(f"{option} must be a positive size, got '{text}'.")
    return size


def format_size(n: int) -> str:
    """Bytes as people read a disk's sizes: '18.3 MB', '1.20 GB' (powers of 1000, as parse_size reads MB and GB)."""
    for unit, factor in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if abs(n) >= factor:
            value = n / factor
            return f"{value:.2f} {unit}" if value < 10 else f"{value:.1f} {unit}"
    return f"{n} bytes"
