"""Cards by name for --gpu, with the memory torch can use on them.

The figure is torch's `get_device_properties(i).total_memory` (what `cudaMemGetInfo` calls total,
and what an out-of-memory message calls "total capacity"): a little under what nvidia-smi shows
and well under the size the card is sold as ("80GB" is 74.5 GiB only as decimal bytes; an H100
80GB gives torch 79.2 GiB). Where no torch figure was found, nvidia-smi's total is used and the
source says so. A size the cards are sold as (`80GB`, `40GB`, `24GB`, ...) means that card: the
smallest usable figure of the cards sold at that size.
"""
from __future__ import annotations

import re

from .units import GiB, MiB

# name -> (usable bytes, sold as (GB), source)
CARDS: dict[str, tuple[int, int, str]] = {
    "H100-80GB": (int(79.2 * GiB), 80, "gpumon's H100 80GB HBM3 screenshots (docs/screenshots): torch total 79.2 GiB "
                                       "(NVML total 79.6 GiB)"),
    "H200": (int(139.80 * GiB), 141, "FACTS.md: H200 out-of-memory message, total capacity 139.80 GiB"),
    "A100-80GB": (int(79.25 * GiB), 80, "levihsu/OOTDiffusion#235: A100 out-of-memory message, 79.25 GiB total capacity"),
    "A100-40GB": (int(39.50 * GiB), 40, "TianheWu/CoSeR#10: A100 out-of-memory message, total capacity 39.50 GiB"),
    "RTX4090": (int(23.64 * GiB), 24, "3DTopia/Phidias-Diffusion#8: RTX 4090 out-of-memory message, total capacity 23.64 GiB"),
    "L40": (int(44.40 * GiB), 48, "NVlabs/Eagle#68: L40 out-of-memory message, total capacity 44.40 GiB"),
    "L40S": (int(44.42 * GiB), 48, "stepfun-ai/Step-Video-T2V#8: L40S out-of-memory message, total capacity 44.42 GiB"),
    "L4": (23034 * MiB, 24, "nvidia-smi total 23034 MiB (no torch figure found; torch's total_memory is a little lower)"),
}
ALIASES = {"H100": "H100-80GB", "H100-SXM": "H100-80GB", "H100-80G": "H100-80GB", "A100": "A100-80GB",
           "A100-80G": "A100-80GB", "A100-40G": "A100-40GB", "RTX-4090": "RTX4090", "4090": "RTX4090",
           "H200-141GB": "H200", "L40S-48GB": "L40S", "L4-24GB": "L4"}


def _key(text: str) -> str:
    return re.sub(r"[\s_]+", "-", text.strip()).upper()


def lookup(text: str) -> tuple[str, int, str] | None:
    """(card name, usable bytes, source) for a card name or a sold size ('H100', 'a100-40gb',
    '80GB'), or None for anything else (then --gpu is read as a size)."""
    k = _key(text)
    table = {_key(n): n for n in CARDS}
    name = table.get(k) or ALIASES.get(k) or table.get(_key(ALIASES.get(k, "")))
    if name:
        return name, CARDS[name][0], CARDS[name][2]
    m = re.fullmatch(r"([0-9]+)\s*GB", text.strip(), re.IGNORECASE)
    if m:
        sold = int(m.group(1))
        cards = sorted((v[0], n) for n, v in CARDS.items() if v[1] == sold)
        if cards:
            usable, name = cards[0]
            names = ", ".join(n for _, n in cards)
            return (names, usable,
                    f"the card sold as {sold}GB: the smallest usable memory of {names} ({CARDS[name][2]})")
    return None


def describe() -> str:
    return ", ".join(f"{n} ({v[0] / GiB:.1f} GiB)" for n, v in CARDS.items())
