from sluice.sources.files import Backlog, FileSource

__all__ = ["Backlog", "FileSource"]
