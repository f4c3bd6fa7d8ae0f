"""The epoch log: sluice's write-ahead log of epoch ranges, states and commits."""

from sluice.store.epoch_log import Epoch, EpochLog, FileSkip, Group, Lease, ManifestEntry, store_url

__all__ = ["Epoch", "EpochLog", "FileSkip", "Group", "Lease", "ManifestEntry", "store_url"]
