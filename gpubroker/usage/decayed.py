"""Fair share's decayed usage, charged from the usage ledger's intervals.

A released lease is charged, to its user's record, the GPU-seconds the
ledger holds it for, decayed (see :mod:`gpubroker.scheduler.fairshare` for
the formula): the weight of each of its slot intervals (device units: 1 for
a device, slices/7 for a MIG instance, memory over the device's for a
share) times the time it was held. A lease held across a broker restart is
therefore not charged the time the broker was down (the ledger's
``broker-down`` gap), exactly as the usage reports count it. A lease the
ledger has not folded yet (at most ``Ledger.flush_interval`` behind) or
holds no interval of (``Ledger.enabled`` off) is charged from its grant to
its release with the lease's own weight: the same figure the ledger will
record.

The ``usage`` rows are a checkpoint of those sums (written by the broker,
:mod:`gpubroker.store.usage_repo`); this module is the pure arithmetic.
Times are UTC epoch seconds (floats), as in the ledger.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable

from ..scheduler import UsageRecord
from ..scheduler.fairshare import decay

#: one slot interval of the ledger: (weight in device units, start, end or
#: ``None`` while open), times in UTC epoch seconds
Segment = tuple[float, float, float | None]

_LN2 = math.log(2)


def held_usage(segments: Iterable[Segment], end_s: float, half_life: float) -> float:
    """Decayed GPU-seconds, as of ``end_s``, of slot intervals held until
    their end (an open one: until ``end_s``); ``half_life`` in seconds (0:
    no decay). Parts after ``end_s`` are not counted."""
    total = 0.0
    for weight, start, end in segments:
        stop = end_s if end is None else min(end, end_s)
        if stop <= start:
            continue
        held = weight * (stop - start)
        if half_life > 0:
            # the integral of 2**(-(end_s - t)/h) over [start, stop]
            held = (
                weight
                * half_life
                / _LN2
                * (2.0 ** (-(end_s - stop) / half_life))
                * (1.0 - 2.0 ** (-(stop - start) / half_life))
            )
        total += held
    return total


def lease_segments(ledger: Iterable[Segment], units: float, granted_s: float) -> list[Segment]:
    """What a lease is charged for: the ledger's slot intervals of it, or,
    when the ledger holds none (not folded yet, or off), one interval of
    ``units`` device units open since its grant (``granted_s``)."""
    segments = list(ledger)
    return segments or [(units, granted_s, None)]


def add_charge(
    record: UsageRecord | None, charge: float, now: dt.datetime, half_life: float
) -> UsageRecord:
    """``record`` (``None``: no past use) decayed to ``now`` (aware UTC)
    plus ``charge`` (decayed GPU-seconds as of ``now``); ``half_life`` in
    seconds. The record's ``as_of`` never goes back (after a clock step
    back it stays): it is the mark after which loading adds releases
    again, so no lease is counted twice (a release stamped before the mark
    after such a step, and not yet written, is the one a crash can lose)."""
    past = (
        0.0
        if record is None
        else decay(record.gpu_seconds, (now - record.as_of).total_seconds(), half_life)
    )
    as_of = now if record is None else max(now, record.as_of)
    return UsageRecord(past + charge, as_of)
