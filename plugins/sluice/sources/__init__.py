from sluice.sources.base import Backlog, Source, source_for
from sluice.sources.files import FileSource

__all__ = ["Backlog", "FileSource", "Source", "source_for"]
