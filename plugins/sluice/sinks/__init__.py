"""Where a keyed write's rows go (``layout``); the tables themselves are written through
``sluice.delta`` by ``sluice.protocol.tables``."""
