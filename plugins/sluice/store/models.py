"""SQLAlchemy tables of the epoch store (sluice's own database, never Airflow's)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Index, Integer, String, Text, UniqueConstraint, false
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class PipelineRow(Base):
    """One row per pipeline: its generation and its lease (the fencing token)."""

    __tablename__ = "sluice_pipelines"
    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    generation: Mapped[int] = mapped_column(Integer, default=0)
    # Fencing token: bumped on every lease acquisition; commits carry it and fail if stale.
    fence: Mapped[int] = mapped_column(BigInteger, default=0)
    lease_owner: Mapped[str | None] = mapped_column(String(500), nullable=True)
    lease_acquired_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    # A rollback in progress ({to_epoch, reason, ...}): set before any table is restored,
    # cleared when the epoch log is rolled back too; no group is planned while it is set.
    pending_rollback: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    # Per table, the last version the Asset events of a finished step reported (acknowledged
    # by the step after it); the next event reports every change since.
    announced: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    # When the store was rebuilt from the tables' records (it then knows the pipeline, even
    # with no epoch published yet).
    rebuilt_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    # What the source is, as it identified itself when its records were first registered (a
    # Kafka topic's ID): a source replaced under the same name is then told apart.
    source_identity: Mapped[dict | None] = mapped_column(JSON, nullable=True)


class SourceFileRow(Base):
    """The persisted manifest of a file source: offset ``position`` is the file's index."""

    __tablename__ = "sluice_source_files"
    __table_args__ = (UniqueConstraint("pipeline", "path", name="uq_source_file_path"),)
    pipeline: Mapped[str] = mapped_column(String(200), primary_key=True)
    position: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    path: Mapped[str] = mapped_column(String(2000))
    size: Mapped[int] = mapped_column(BigInteger)
    mtime: Mapped[float] = mapped_column()
    discovered_at: Mapped[datetime] = mapped_column(DateTime)
    # An operator skipped the file on purpose (gone, unreadable): epochs read around it.
    skipped_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    skipped_by: Mapped[str | None] = mapped_column(String(500), nullable=True)
    skip_reason: Mapped[str | None] = mapped_column(Text, nullable=True)


class GroupRow(Base):
    __tablename__ = "sluice_groups"
    pipeline: Mapped[str] = mapped_column(String(200), primary_key=True)
    group_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    owner: Mapped[str] = mapped_column(String(500))
    fence: Mapped[int] = mapped_column(BigInteger)
    first_epoch: Mapped[int] = mapped_column(Integer)
    last_epoch: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(20))  # planned | committed | published | failed
    plan: Mapped[dict] = mapped_column(JSON, default=dict)  # epoch size, k, reason, ...
    planned_at: Mapped[datetime] = mapped_column(DateTime)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)


class EpochRow(Base):
    """One epoch of one generation. Epoch ids are dense per pipeline."""

    __tablename__ = "sluice_epochs"
    # A group's epochs are read by group, in epoch order (each group of the console's list, a
    # rerun's group): without it each read scanned the pipeline's epochs, 4 ms a group at 30,000
    # epochs. In epoch order too, or SQLite prefers the primary key to spare itself the sort.
    __table_args__ = (Index("ix_sluice_epochs_group", "pipeline", "group_id", "epoch_id", "generation"),)
    pipeline: Mapped[str] = mapped_column(String(200), primary_key=True)
    epoch_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    generation: Mapped[int] = mapped_column(Integer, primary_key=True)
    group_id: Mapped[int] = mapped_column(Integer)
    start_offset: Mapped[int] = mapped_column(BigInteger)
    end_offset: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(20))
    attempts: Mapped[int] = mapped_column(Integer, default=0)  # ever started, never reset
    # Since an operator's last reset: attempts that recorded an error, and attempts that ended
    # without a word (a killed or out-of-memory driver); an attempt in flight is open.
    failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    crashes: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    attempt_open: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    delta_versions: Mapped[dict] = mapped_column(JSON, default=dict)  # sink -> version
    rows: Mapped[dict] = mapped_column(JSON, default=dict)  # input / output / rejected counts
    timings: Mapped[dict] = mapped_column(JSON, default=dict)  # seconds per phase
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    validation: Mapped[dict | None] = mapped_column(JSON, nullable=True)  # sink -> expectation results
    planned_at: Mapped[datetime] = mapped_column(DateTime)
    committed_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    published_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    # The generation the epoch was written in, when a rollback carried it into a later one
    # unchanged (NULL: written in ``generation`` itself).
    origin_generation: Mapped[int | None] = mapped_column(Integer, nullable=True)


class RollbackRow(Base):
    """A finished rollback's record (``sluice.store.records``), kept so the copies next to the
    tables can be written again when a crash left one out."""

    __tablename__ = "sluice_rollbacks"
    pipeline: Mapped[str] = mapped_column(String(200), primary_key=True)
    generation: Mapped[int] = mapped_column(Integer, primary_key=True)  # the generation it started
    record: Mapped[dict] = mapped_column(JSON)
    recorded_at: Mapped[datetime] = mapped_column(DateTime)


class ControlRow(Base):
    """The adaptive controllers' state of one pipeline (``sluice.control.ControlState`` as JSON),
    saved after every group so it survives restarts."""

    __tablename__ = "sluice_control"
    pipeline: Mapped[str] = mapped_column(String(200), primary_key=True)
    state: Mapped[dict] = mapped_column(JSON)
    updated_at: Mapped[datetime] = mapped_column(DateTime)
