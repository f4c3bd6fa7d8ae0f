"""Skew-aware key partitioning after Prompt (Abdelhamid et al., SIGMOD'20), pure Python.

* :func:`plan_blocks` is the Micro-Batch Partitioner of §4.2 (Alg. 2), a greedy heuristic for
  *Balanced Bin Packing with Fragmentable Items* (B-BPFI, Def. 1): P blocks of (nearly) equal
  size, nearly equal key cardinality, few split keys.
* :func:`reduce_bucket_allocator` is the Reduce Bucket Allocator of §5 (Alg. 3), Worst-Fit for
  *Balanced Bin Packing with Variable Capacity* (B-BPVC, Def. 2), run by each map task alone;
  :func:`reduce_placement` runs it for every block of a plan and merges the answers.
* :func:`spark_hash_partition` reproduces Spark's ``HashPartitioning`` (Murmur3, seed 42,
  ``pmod``) so that plain hash partitioning can be predicted and compared without Spark
  (:func:`hash_partition_sizes`, :func:`hash_imbalance`).

Key frequencies come from an exact pre-pass over the epoch or from recent epochs (the run-once
analogue of Alg. 1's CountTree, §4.1); this module only consumes a ``{key: count}`` mapping.
No Spark, no Airflow.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Key = Hashable
Fragment = tuple[Key, int]  # (key, tuples of that key in one block)

__all__ = [
    "BlockPlan",
    "ReducePlan",
    "hash_imbalance",
    "hash_partition_sizes",
    "imbalance",
    "placement_sizes",
    "plan_blocks",
    "reduce_bucket_allocator",
    "reduce_placement",
    "spark_hash",
    "spark_hash_partition",
]


# --------------------------------------------------------------------------------------------
# Metrics (§3.3)
# --------------------------------------------------------------------------------------------

def imbalance(sizes: Sequence[float]) -> float:
    """max / mean of partition sizes (1.0 = perfectly balanced; 1.0 for an empty input)."""
    if not sizes:
        raise ValueError("no partitions")
    total = float(sum(sizes))
    return max(sizes) * len(sizes) / total if total > 0 else 1.0


@dataclass(frozen=True)
class BlockPlan:
    """A map-stage plan (Alg. 2 output): ``blocks[b]`` lists the (key, count) fragments of block b.

    ``fragments[k]`` gives the reverse view, ``((block, count), ...)`` in block order; a key is in
    ``split_keys`` iff it has more than one fragment (its "reference table" flag, §5).
    """

    n_blocks: int
    blocks: tuple[tuple[Fragment, ...], ...]
    split_keys: frozenset[Key]
    capacities: tuple[int, ...]
    s_cut: float
    fragments: Mapping[Key, tuple[tuple[int, int], ...]] = field(repr=False, compare=False)

    @property
    def total(self) -> int:
        """N_C, the tuples planned."""
        return sum(self.block_sizes)

    @property
    def n_keys(self) -> int:
        """K, the distinct keys planned."""
        return len(self.fragments)

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """|b_j|: tuples per block."""
        return tuple(sum(c for _, c in blk) for blk in self.blocks)

    @property
    def block_cardinalities(self) -> tuple[int, ...]:
        """||b_j||: distinct keys per block."""
        return tuple(len(blk) for blk in self.blocks)

    @property
    def imbalance(self) -> float:
        """max / mean block size."""
        return imbalance(self.block_sizes)

    @property
    def bsi(self) -> float:
        """Block-size imbalance, Eqn. 2: max |b| - avg |b|."""
        sizes = self.block_sizes
        return max(sizes) - sum(sizes) / len(sizes)

    @property
    def bci(self) -> float:
        """Block-cardinality imbalance, Eqn. 4: max ||b|| - avg ||b||."""
        cards = self.block_cardinalities
        return max(cards) - sum(cards) / len(cards)

    @property
    def ksr(self) -> float:
        """Key-split ratio, Eqn. 5: fragments / keys (1.0 when no key is split)."""
        return sum(len(f) for f in self.fragments.values()) / self.n_keys if self.n_keys else 1.0

    @property
    def split_cost(self) -> int:
        """Key-split cost, the objective of Eqn. 7 minus K: fragments beyond one per key."""
        return sum(len(f) - 1 for f in self.fragments.values())

    def mpi(self, p1: float = 1 / 3, p2: float = 1 / 3, p3: float = 1 / 3) -> float:
        """Partitioning imbalance, Eqn. 6, with BSI and BCI divided by their averages so the three
        terms are unitless (the paper leaves the units mixed)."""
        sizes, cards = self.block_sizes, self.block_cardinalities
        avg_s, avg_c = sum(sizes) / len(sizes), sum(cards) / len(cards)
        return (p1 * (self.bsi / avg_s if avg_s else 0.0) + p2 * (self.bci / avg_c if avg_c else 0.0)
                + p3 * self.ksr)

    def block_of(self, key: Key) -> int:
        """The one block of a non-split key."""
        frags = self.fragments[key]
        if len(frags) != 1:
            raise KeyError(f"{key!r} is split over blocks {[b for b, _ in frags]}")
        return frags[0][0]

    def metrics(self) -> dict[str, Any]:
        """The plan's figures as plain JSON-able values."""
        return {"n_blocks": self.n_blocks, "tuples": self.total, "keys": self.n_keys,
                "block_sizes": list(self.block_sizes), "block_cardinalities": list(self.block_cardinalities),
                "imbalance": round(self.imbalance, 4), "bsi": round(self.bsi, 3), "bci": round(self.bci, 3),
                "ksr": round(self.ksr, 4), "split_keys": len(self.split_keys), "split_cost": self.split_cost,
                "s_cut": round(self.s_cut, 3)}


def _sort_desc(frequencies: Mapping[Key, int]) -> list[Fragment]:
    """The SortedList of Alg. 2's input: keys by descending count, ties in a canonical order so a
    plan does not depend on the order statistics were collected in."""
    items = [(k, int(c)) for k, c in frequencies.items() if int(c) > 0]
    try:
        return sorted(items, key=lambda kc: (-kc[1], kc[0]))
    except TypeError:  # keys of mixed, unorderable types
        return sorted(items, key=lambda kc: (-kc[1], type(kc[0]).__name__, repr(kc[0])))


def plan_blocks(frequencies: Mapping[Key, int], P: int) -> BlockPlan:
    """Micro-Batch Partitioner, §4.2 Alg. 2 (B-BPFI greedy) over ``{key: count}`` into P blocks.

    P_Size = N_C/P, P_|k| = K/P, S_Cut = P_Size/P_|k| (= N_C/K, the mean key frequency).
    1. Keys with |k| > S_Cut, descending: an S_Cut fragment goes to b_i, the residual to RList,
       ``lookupLargePos[k] = b_i``, i = (i+1) % P.
    2. The other keys are dealt one per block, reversing the block order after each pass
       (zig-zag, ≈ Best-Fit-Decreasing without tracking sizes). [AMBIG] whether the deal starts at
       b_1 or at the b_i where phase 1 stopped: "move to next b" is read as the latter, which
       serves the blocks without a heavy fragment first.
    3. Residuals in RList order: if k fits in its home block, add it there; else fill the home
       block and put the rest into the block with the lowest remaining capacity that can hold it
       (Best-Fit). [UNSPEC] when no block can hold it: fill blocks by descending remaining
       capacity until it is placed.

    Capacities are integers summing to N_C (the first N_C mod P blocks hold one more tuple), and
    no block ever exceeds its capacity (Def. 1 (1)); the paper's phases 1-2 do not check it, so
    [FIX] a phase 1 fragment is ⌊S_Cut⌋ tuples or b_i's remaining room if smaller, and a phase 2
    key that does not fit its turn's block goes whole to the roomiest block, or, if no block can
    hold it whole (few keys, P > K), joins the residuals with that block as its home. A key whose
    residual fits back into its home block ends up unsplit.
    """
    if P < 1:
        raise ValueError(f"need P >= 1 blocks (got {P})")
    sorted_list = _sort_desc(frequencies)
    N_C = sum(c for _, c in sorted_list)
    K = len(sorted_list)
    base, extra = divmod(N_C, P)
    capacities = tuple(base + (1 if j < extra else 0) for j in range(P))
    P_size = N_C / P
    P_card = K / P
    S_cut = P_size / P_card if K else 0.0
    cut = max(1, math.floor(S_cut))

    load = [0] * P
    content: list[dict[Key, int]] = [{} for _ in range(P)]

    def put(k: Key, b: int, c: int) -> None:
        if c > 0:
            content[b][k] = content[b].get(k, 0) + c
            load[b] += c

    # Phase 1 (lines 4-9): fragment the heavy keys, round-robin over the blocks.
    rlist: list[Fragment] = []
    lookup_large_pos: dict[Key, int] = {}
    b_i = 0
    pos = 0
    while pos < K and sorted_list[pos][1] > S_cut:
        k, c = sorted_list[pos]
        first = min(cut, capacities[b_i] - load[b_i])  # never past b_i's capacity (Def. 1 (1))
        put(k, b_i, first)
        rlist.append((k, c - first))
        lookup_large_pos[k] = b_i
        b_i = (b_i + 1) % P
        pos += 1

    # Phase 2 (lines 10-16): zig-zag deal of the remaining keys, starting at b_i. A key that
    # does not fit its turn's block goes whole to the block with the most room; if none can hold
    # it (few keys, or P > K) it joins the residuals with that turn's block as its home.
    order = [(b_i + j) % P for j in range(P)]
    while pos < K:
        for b in order:
            if pos >= K:
                break
            k, c = sorted_list[pos]
            pos += 1
            target = b
            if c > capacities[b] - load[b]:  # the turn is spent; the key goes where it fits
                target = min(range(P), key=lambda j: (load[j] - capacities[j], j))
                if c > capacities[target] - load[target]:
                    rlist.append((k, c))
                    lookup_large_pos[k] = b
                    continue
            put(k, target, c)
        order.reverse()

    # Phase 3 (lines 17-25): residuals, key locality first, then Best-Fit.
    for k, r in rlist:
        if r <= 0:
            continue
        b = lookup_large_pos[k]
        room = capacities[b] - load[b]
        if r <= room:
            put(k, b, r)
            continue
        if room > 0:
            put(k, b, room)
            r -= room
        fits = [j for j in range(P) if capacities[j] - load[j] >= r]
        if fits:
            put(k, min(fits, key=lambda j: (capacities[j] - load[j], j)), r)
            continue
        for j in sorted(range(P), key=lambda j: (-(capacities[j] - load[j]), j)):  # [UNSPEC] spread
            take = min(r, capacities[j] - load[j])
            if take > 0:
                put(k, j, take)
                r -= take
            if r == 0:
                break
        if r > 0:  # unreachable: the capacities sum to N_C; kept as a guard
            put(k, min(range(P), key=lambda j: (load[j], j)), r)

    fragments: dict[Key, list[tuple[int, int]]] = {}
    for b in range(P):
        for k, c in content[b].items():
            fragments.setdefault(k, []).append((b, c))
    split = frozenset(k for k, f in fragments.items() if len(f) > 1)
    return BlockPlan(
        n_blocks=P,
        blocks=tuple(tuple(content[b].items()) for b in range(P)),
        split_keys=split,
        capacities=capacities,
        s_cut=S_cut,
        fragments={k: tuple(f) for k, f in fragments.items()},
    )


# --------------------------------------------------------------------------------------------
# Spark-compatible hashing (org.apache.spark.unsafe.hash.Murmur3_x86_32, seed 42)
# --------------------------------------------------------------------------------------------

_M32 = 0xFFFFFFFF
SPARK_SEED = 42


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _M32


def _mix_k1(k1: int) -> int:
    k1 = (k1 * 0xCC9E2D51) & _M32
    k1 = _rotl(k1, 15)
    return (k1 * 0x1B873593) & _M32


def _mix_h1(h1: int, k1: int) -> int:
    h1 ^= k1
    h1 = _rotl(h1, 13)
    return (h1 * 5 + 0xE6546B64) & _M32


def _fmix(h1: int, length: int) -> int:
    h1 ^= length
    h1 ^= h1 >> 16
    h1 = (h1 * 0x85EBCA6B) & _M32
    h1 ^= h1 >> 13
    h1 = (h1 * 0xC2B2AE35) & _M32
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 & 0x80000000 else h1


def spark_hash(value: Any, spark_type: str | None = None, seed: int = SPARK_SEED) -> int:
    """Spark SQL's ``hash(value)`` (Murmur3Hash, seed 42) as a signed 32-bit int.

    ``spark_type`` is the column's type: ``"int"`` (hashInt), ``"long"`` (hashLong) or
    ``"string"`` (UTF-8 bytes through ``hashUnsafeBytes``, tail bytes one by one, sign-extended).
    By default a Python ``int`` is taken as ``"long"`` (what PySpark infers and what
    ``spark.range`` yields) and a ``str`` as ``"string"``; ``None`` hashes to the seed.
    """
    if value is None:
        return seed
    if spark_type is None:
        if isinstance(value, bool):
            raise TypeError("boolean keys are not supported")
        spark_type = "long" if isinstance(value, int) else "string" if isinstance(value, str) else ""
    h1 = seed & _M32
    if spark_type == "int":
        return _fmix(_mix_h1(h1, _mix_k1(value & _M32)), 4)
    if spark_type == "long":
        v = value & 0xFFFFFFFFFFFFFFFF
        h1 = _mix_h1(h1, _mix_k1(v & _M32))
        h1 = _mix_h1(h1, _mix_k1(v >> 32))
        return _fmix(h1, 8)
    if spark_type == "string":
        data = value.encode("utf-8")
        aligned = len(data) - len(data) % 4
        for (word,) in struct.iter_unpack("<I", data[:aligned]):
            h1 = _mix_h1(h1, _mix_k1(word))
        for byte in data[aligned:]:
            h1 = _mix_h1(h1, _mix_k1((byte - 256 if byte > 127 else byte) & _M32))
        return _fmix(h1, len(data))
    raise TypeError(f"no Spark hash for {type(value).__name__} (spark_type={spark_type!r})")


def spark_hash_partition(key: Key, n: int, spark_type: str | None = None) -> int:
    """The partition Spark's ``HashPartitioning`` gives ``key`` among n: ``pmod(hash(key), n)``."""
    return spark_hash(key, spark_type) % n  # Python's % of a signed int by n > 0 is pmod


# --------------------------------------------------------------------------------------------
# Reduce stage (§5)
# --------------------------------------------------------------------------------------------

def reduce_bucket_allocator(clusters: Mapping[Key, int], R: int, split_keys: Collection[Key] = (),
                            hash_fn: Callable[[Key, int], int] = spark_hash_partition,
                            *, first_bucket: int = 0) -> dict[Key, int]:
    """Reduce Bucket Allocator, §5 Alg. 3 (B-BPVC by Worst-Fit), for ONE map task's clusters.

    Bucket_size = |C|/|R|; split-key clusters go to ``hash_fn(k, R)`` (every map task must send a
    split key to the same reducer), which lowers those buckets' capacities; the non-split clusters,
    largest first, each go to the available bucket with the most remaining capacity (Worst-Fit),
    which then leaves the candidate set until every bucket has received one ([AMBIG] line 8 of
    the pseudo-code is inverted; the text's reading is used). Ties go to the first bucket at or
    after ``first_bucket`` (cyclically): map tasks that do not coordinate must not all break their
    ties towards the same buckets (:func:`reduce_placement` staggers them).
    Returns ``{key: bucket}`` for every key of ``clusters``.
    """
    if R < 1:
        raise ValueError(f"need R >= 1 buckets (got {R})")
    split = set(split_keys)
    bucket_size = sum(clusters.values()) / R
    cap = [bucket_size] * R
    out: dict[Key, int] = {}
    for k, c in clusters.items():
        if k in split:
            r = hash_fn(k, R)
            out[k] = r
            cap[r] -= c
    non_split = _sort_desc({k: c for k, c in clusters.items() if k not in split})
    non_split += [(k, c) for k, c in clusters.items() if k not in split and c <= 0]
    avail = list(range(R))
    for k, c in non_split:
        r = max(avail, key=lambda j: (cap[j], -((j - first_bucket) % R)))
        out[k] = r
        cap[r] -= c
        avail.remove(r)
        if not avail:
            avail = list(range(R))
    return out


@dataclass(frozen=True)
class ReducePlan:
    """Where each key is reduced: ``placement[k]`` is its reduce partition; ``bucket_sizes`` are
    tuples per reduce partition (summed over the map tasks' clusters)."""

    n_reducers: int
    placement: Mapping[Key, int] = field(repr=False)
    bucket_sizes: tuple[int, ...]

    @property
    def imbalance(self) -> float:
        return imbalance(self.bucket_sizes)


def reduce_placement(plan: BlockPlan, R: int,
                     hash_fn: Callable[[Key, int], int] = spark_hash_partition) -> ReducePlan:
    """Alg. 3 run independently by every block's map task (no coordination, §5), merged.

    A non-split key occurs in one block only, so exactly one map task places it; a split key is
    placed by ``hash_fn`` identically by every task holding a fragment of it. Split keys are thus
    reduced in two phases: a partial result per block (map side), merged at ``hash_fn(k, R)``.
    [FIX] Block b breaks Worst-Fit's ties from bucket ⌊b·R/P⌋ on: with ties to bucket 0 in every
    task, each task's first clusters (and a block with fewer clusters than R, all of them) piled
    onto the same low buckets, far worse than hashing when P·clusters per block is near R.
    """
    placement: dict[Key, int] = {}
    sizes = [0] * R
    for b, blk in enumerate(plan.blocks):
        clusters = dict(blk)
        local = reduce_bucket_allocator(clusters, R, plan.split_keys & clusters.keys(), hash_fn,
                                        first_bucket=b * R // plan.n_blocks)
        for k, r in local.items():
            if placement.setdefault(k, r) != r:  # pragma: no cover - would be a bug in Alg. 3's use
                raise AssertionError(f"map tasks disagree on the reducer of {k!r}")
            sizes[r] += clusters[k]
    return ReducePlan(n_reducers=R, placement=placement, bucket_sizes=tuple(sizes))


# --------------------------------------------------------------------------------------------
# Comparing placements
# --------------------------------------------------------------------------------------------

def placement_sizes(frequencies: Mapping[Key, int], placement: Mapping[Key, int | Iterable[tuple[int, int]]],
                    n: int) -> list[int]:
    """Tuples per partition when ``placement`` maps each key to a partition or to
    ``(partition, count)`` fragments (as :attr:`BlockPlan.fragments`)."""
    sizes = [0] * n
    for k, c in frequencies.items():
        where = placement[k]
        if isinstance(where, int):
            sizes[where] += int(c)
        else:
            for b, part in where:
                sizes[b] += part
    return sizes


def hash_partition_sizes(frequencies: Mapping[Key, int], n: int,
                         hash_fn: Callable[[Key, int], int] = spark_hash_partition) -> list[int]:
    """Tuples per partition under hash partitioning (by default exactly Spark's)."""
    return placement_sizes(frequencies, {k: hash_fn(k, n) for k in frequencies}, n)


def hash_imbalance(frequencies: Mapping[Key, int], n: int,
                   hash_fn: Callable[[Key, int], int] = spark_hash_partition) -> float:
    """max / mean partition size under hash partitioning of the same frequencies."""
    return imbalance(hash_partition_sizes(frequencies, n, hash_fn))
