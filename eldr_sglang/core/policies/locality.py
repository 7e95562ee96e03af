"""The locality pick of ``eldr_balanced``: bounded load, then a similarity band, then the cheapest.

Pure functions over Python lists (a decision at 24 servers is a few microseconds of list
work; numpy calls cost more at this size), shared by :mod:`.eldr_balanced` and its tests:

1. :func:`bounded` -- consistent hashing with bounded loads: a server may take the request
   only while its in-flight count is below ``ceil(load_cap * (in flight + 1) / servers)``.
   The least loaded candidate always passes (its count is at most the mean, which is
   below the cap), so the filter never empties;
2. :func:`region_band` -- the candidates whose region similarity is within ``sim_band``
   (cosine) of the most similar candidate: the request's home region, and its next
   best ones when the home servers are at the cap. It always holds the most similar one;
3. the cheapest of the band by the state-aware cost (the marginal decode time of each
   server's live batch), so co-owners and near regions split a region's traffic by what
   each batch would pay.

:func:`band_width` widens the similarity band with load; :func:`queue_band` is the cost-band
rule's band, wider once every batch is full.

Where ``eldr`` (least loaded within tau of the best similarity, no cap) piles a burst of
one kind onto its region, the cap sends the overflow to the next most similar region;
where the plain cost band (cheapest, then similarity within 2% of it) lets the momentary
cost pick 72-83% of the servers alone (its regions dissolve as batches turn over), the
similarity band keeps each region's batches of one kind, which pays over every step of a
request's stay and for the next arrivals of its kind.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence


def bounded(cand: list[int], loads: Sequence[int], load_cap: Optional[float], slack: float = 0.0) -> list[int]:
    """The candidates below their bounded-load capacity ``ceil(load_cap * mean + slack)``, mean
    the candidates' in-flight count with the request, ``slack`` requests on top (a few requests
    of imbalance cost little while batches are small); ``cand`` itself if ``load_cap`` is None
    or fewer than two candidates. Never empty for a non-empty ``cand``."""
    if load_cap is None or len(cand) < 2:
        return cand
    cap = math.ceil(load_cap * (_total(loads, cand) + 1) / len(cand) + slack)
    return [i for i in cand if loads[i] < cap] or cand


def _total(loads: Sequence[int], cand: list[int]) -> int:
    """The candidates' in-flight count (every server's: one C-level sum)."""
    return sum(loads) if len(cand) == len(loads) else sum(loads[i] for i in cand)


def region_band(cand: list[int], sims: Sequence[float], sim_band: float) -> list[int]:
    """The candidates within ``sim_band`` of the most similar candidate (never empty for a
    non-empty ``cand``; similarities that are not numbers count as -inf)."""
    key = [sims[i] if sims[i] == sims[i] else -math.inf for i in cand]
    best = max(key)
    if best == -math.inf:
        return list(cand)
    floor = best - sim_band - 1e-9
    return [i for i, s in zip(cand, key) if s >= floor]


def band_width(sim_band: float, sim_band_full: Optional[float], loads: Sequence[int], cand: list[int],
               full: int) -> float:
    """The similarity band at the candidates' mean in-flight count: ``sim_band`` on an idle
    cluster, growing linearly to ``sim_band_full`` as the mean reaches ``full`` (a full batch),
    constant beyond (``sim_band`` alone if ``sim_band_full`` is None)."""
    if sim_band_full is None or not cand:
        return sim_band
    mean = _total(loads, cand) / len(cand)
    return sim_band + (sim_band_full - sim_band) * min(1.0, mean / max(full, 1))


def queue_band(band: float, band_full: Optional[float], loads: Sequence[int], cand: list[int], full: int) -> float:
    """The cost band: ``band`` until the candidates' mean in-flight count reaches ``full`` (every
    batch full: requests queue, and a step's distinct experts set the throughput), then
    ``band_full`` (``band`` alone if ``band_full`` is None)."""
    if band_full is None or not cand:
        return band
    return band_full if _total(loads, cand) >= full * len(cand) else band


def locality_pick(cand: list[int], loads: Sequence[int], costs: Sequence[float], sims: Sequence[float],
                  load_cap: Optional[float], sim_band: float) -> tuple[int, list[int]]:
    """(server, band): bounded load, then the similarity band, then the least cost (ties:
    the more similar, then the lower index)."""
    band = region_band(bounded(cand, loads, load_cap), sims, sim_band)
    return min(band, key=lambda i: (costs[i], -sims[i], i)), band
