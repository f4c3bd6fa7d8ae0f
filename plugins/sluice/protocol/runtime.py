"""What a run works with besides its spec and its store: the tables (the Delta facade), the data
plane (``sluice.compute``), how a long step keeps its lease alive, and how to tell whether the
run holding a lease is still going. ``Runtime.spark`` is production's; the simulation builds one
over the twin."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from sluice.delta import Tables
from sluice.model import Lease
from sluice.protocol.leases import LeaseKeeper

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from sluice.compute import Compute
    from sluice.spec import PipelineSpec
    from sluice.store import EpochStore


class Runtime:
    """``tables``: a ``Tables`` or a factory of one (called once, when a step first needs a
    table: a run that finds nothing to do never starts Spark); ``compute(spec, store, tables)``
    makes a pipeline's data plane; ``keeper(store, lease, ttl_s)`` a context that keeps the lease
    alive; ``alive(owner)``: whether another lease holder is still going (Airflow's DAG run
    state), ``None`` when nothing can tell."""

    def __init__(self, tables: Tables | Callable[[], Tables],
                 compute: Callable[[PipelineSpec, EpochStore, Tables], Compute], *,
                 keeper: Callable[[EpochStore, Lease, float], AbstractContextManager[Any]] = LeaseKeeper,
                 alive: Callable[[str], bool] | None = None,
                 release: Callable[[], None] | None = None) -> None:
        self._tables = tables
        self._compute = compute
        self.keeper = keeper
        self.alive = alive
        self._release = release
        self._computes: dict[str, Compute] = {}

    @property
    def tables(self) -> Tables:
        if not isinstance(self._tables, Tables):
            self._tables = self._tables()
        return self._tables

    def compute(self, spec: PipelineSpec, store: EpochStore) -> Compute:
        """The pipeline's data plane (one per pipeline and runtime)."""
        found = self._computes.get(spec.name)
        if found is None:
            found = self._computes[spec.name] = self._compute(spec, store, self.tables)
        return found

    def close(self) -> None:
        """Stop what this runtime started (its SparkSession, when it made one)."""
        if self._release is not None:
            self._release()

    @classmethod
    def spark(cls, spark: SparkSession | Callable[[], SparkSession], *, alive: Callable[[str], bool] | None = None,
              stop: bool = False) -> Runtime:
        """Real Delta and Spark: ``spark`` or a factory of it (started on first use); with
        ``stop``, ``close`` stops it."""
        from sluice.compute import SparkCompute
        from sluice.delta.spark import SparkTables

        session: dict[str, SparkSession] = {}

        def get() -> SparkSession:
            if "spark" not in session:
                session["spark"] = spark if type(spark).__name__ == "SparkSession" else spark()  # type: ignore[operator]
            return session["spark"]

        def compute(spec: PipelineSpec, store: EpochStore, tables: Tables) -> Compute:
            return SparkCompute(spec, store, get(), tables)  # type: ignore[arg-type]

        def release() -> None:
            if stop and "spark" in session:
                session["spark"].stop()

        return cls(SparkTables(get), compute, alive=alive, release=release)

    @property
    def spark_session(self) -> SparkSession:
        """The SparkSession of a Spark runtime (starting it if need be)."""
        return self.tables.spark  # type: ignore[attr-defined]
