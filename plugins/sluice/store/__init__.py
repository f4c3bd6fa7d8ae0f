"""The epoch store: sluice's write-ahead log of epoch ranges, states and commits (persistence
only; the protocol decides what is written)."""

from sluice.model import Epoch, FileSkip, Group, Lease, ManifestEntry
from sluice.store.epoch_store import EpochStore, PipelineState, StoreTx, store_url

__all__ = ["Epoch", "EpochStore", "FileSkip", "Group", "Lease", "ManifestEntry", "PipelineState", "StoreTx",
           "store_url"]
