"""Deterministic simulation of sluice's protocol: the real protocol code and the real epoch
store, the Delta twin (``sluice.delta.twin``) and a plain-Python data plane, actors interleaved
by a seeded scheduler at every step boundary, with kills, pauses past the lease, clock jumps and
source faults; invariants checked after every schedule. ``python -m sluice.sim`` (``make sim``)."""
