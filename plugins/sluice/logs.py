"""What sluice's processes log: sluice's own lines (plans, commits, validation summaries) at
INFO, the libraries only their warnings.

Great Expectations alone writes ~200 INFO lines when it is imported (its docs decorators) and
py4j one per connection: in a task log the plan, the commits and the validation summary drowned
in them (measured: 213 Great Expectations lines and 3 of py4j against 2 of sluice for one group).
``SLUICE_LOG_LEVEL=DEBUG``, or a job's ``--verbose``, brings every library back.
"""

from __future__ import annotations

import logging
import os

#: Loggers of libraries sluice runs whose INFO lines say nothing an operator needs.
LIBRARIES = ("great_expectations", "py4j", "urllib3", "filelock", "matplotlib", "numexpr", "tzlocal", "alembic")

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def verbose_requested() -> bool:
    return os.environ.get("SLUICE_LOG_LEVEL", "").upper() == "DEBUG"


def quiet_libraries(verbose: bool | None = None) -> None:
    """Libraries log warnings and errors only, unless ``verbose`` (default:
    ``SLUICE_LOG_LEVEL=DEBUG``). Call it before they are imported: some log at import."""
    verbose = verbose_requested() if verbose is None else verbose
    for name in LIBRARIES:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.WARNING)
    if verbose:
        return
    # Some modules set their own logger to INFO when imported (Great Expectations'
    # data_context.types.base): call this again after importing them; they then inherit WARNING.
    modules = tuple(f"{name}." for name in LIBRARIES)
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith(modules) and isinstance(logger, logging.Logger) and 0 < logger.level < logging.WARNING:
            logger.setLevel(logging.NOTSET)


def configure_job(verbose: bool = False) -> None:
    """Logging of a command-line job (``jobs/``): sluice at INFO (DEBUG when verbose), to stderr."""
    verbose = verbose or verbose_requested()
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=FORMAT)
    quiet_libraries(verbose)
