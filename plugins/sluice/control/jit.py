"""JIT by size: which compiler a run-once driver gets, from the records its planned group holds.

C2 compiles hot code into faster code than C1 but spends CPU compiling first; a driver that lives
for one group pays that before the faster code earns it back. ``bench/jit.py`` measures both
compilers' CPU-seconds on groups of growing size and fits ``fixed + per_record * records`` to
each; where the lines cross is ``C2_BREAK_EVEN_RECORDS``. Below it (and whenever the size is not
known: a pipeline's first groups) the driver runs C1 alone. Pure logic: no Spark, no store.

>>> compiler_for(None)
'c1'
>>> compiler_for(C2_BREAK_EVEN_RECORDS * 2)
'c2'
>>> estimate_records([1000, 3000], sizes_are_records=False, history=[(4_000, 20), (6_000, 30)])
20
"""

from __future__ import annotations

from collections.abc import Sequence

#: The group size (records) above which C2 costs fewer CPU-seconds than C1 in a run-once driver:
#: YSB's aggregate on ``local[2]``, ``bench/results/jit.json`` (``break_even_records``).
C2_BREAK_EVEN_RECORDS = 1_400_000

COMPILERS = ("c1", "c2")


def estimate_records(sizes: Sequence[int], *, sizes_are_records: bool,
                     history: Sequence[tuple[int, int]] = ()) -> int | None:
    """The records of a group whose manifest entries have ``sizes``: the sizes themselves when
    they count records (Kafka chunks), else bytes at the bytes per record the pipeline's published
    epochs had (``history``: ``(bytes, records)`` per epoch); ``None`` with nothing to go by."""
    total = sum(sizes)
    if sizes_are_records:
        return total
    read_bytes = sum(b for b, r in history if b > 0 and r > 0)
    records = sum(r for b, r in history if b > 0 and r > 0)
    if not read_bytes or not records:
        return None
    return round(total * records / read_bytes)


def compiler_for(records: int | None, break_even: int | None = C2_BREAK_EVEN_RECORDS) -> str:
    """``"c2"`` when the group holds at least ``break_even`` records, else ``"c1"`` (also when
    either is unknown: C1 is the cheaper side of every small group)."""
    if records is None or break_even is None or records < break_even:
        return "c1"
    return "c2"
