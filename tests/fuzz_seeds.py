"""The seeds the fuzz tests run: a few regression seeds in the suite, a range in a campaign.

``make fuzz FUZZ_SEEDS=0-199`` sets SPLITSERVE_FUZZ_SEEDS, which replaces each fuzz test's own
seeds: "A-B" (inclusive) or "a,b,c"."""

import os


def fuzz_seeds(default: list[int]) -> list[int]:
    spec = os.environ.get("SPLITSERVE_FUZZ_SEEDS", "").strip()
    if not spec:
        return default
    seeds: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        seeds.extend(range(int(lo), int(hi or lo) + 1))
    return seeds
