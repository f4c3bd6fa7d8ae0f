"""Errors sluice raises on purpose: each names the pipeline and what to look at."""

from __future__ import annotations


class SluiceError(Exception):
    """Base class of sluice's own errors."""


class SpecError(SluiceError):  # raised at parse time too, where no task runs
    """A pipeline spec is invalid: the message names the file and the field."""


class SourceError(SluiceError):
    """The source cannot deliver a range: missing folder, unreadable or vanished file."""


class PipelineBusyError(SluiceError):
    """Another run holds the pipeline's lease: at most one group per pipeline is in flight."""


class OperatorActionRequired(SluiceError):
    """A failure no retry can fix: an operator must act (recover, roll back, skip a file, fix
    the spec). Airflow tasks fail at once on it, without their retries."""


class StoreLostError(OperatorActionRequired):
    """The epoch store does not know a pipeline whose tables hold its commits."""


class FencedError(OperatorActionRequired):
    """This run's lease was taken over by a newer run; it must stop without committing."""


class SharedTableError(OperatorActionRequired):
    """A table the pipeline would RESTORE also holds rows of another pipeline: each pipeline
    needs its own tables."""


class ProtocolError(SluiceError):
    """The epoch log would break an invariant (contiguity, state order)."""


class PipelineHaltedError(OperatorActionRequired):
    """The pipeline stopped on a failure an operator must look at (validation under the
    ``fail`` policy, an epoch failing repeatedly, a rollback left half done)."""


class TransformError(SluiceError):
    """The transform cannot run on any input: a SQL transform Spark cannot analyse (an unknown
    column or table, a syntax error). The message names the pipeline, the spec file and the
    field; it counts as a failed attempt (``control.max_attempts``), as a transform's bug does."""
