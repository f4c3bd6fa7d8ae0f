from sluice.sinks.delta import DeltaSink, SinkCommit

__all__ = ["DeltaSink", "SinkCommit"]
