"""The epoch store's schema migrations (``sluice.store.schema``), on SQLite and on a real
Postgres server: they build exactly the models' schema, adopt a store an earlier release made,
survive processes opening a new store at once, and refuse a store a newer release migrated."""

from __future__ import annotations

import multiprocessing

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from sluice.errors import ProtocolError
from sluice.protocol.leases import acquire_lease
from sluice.store import EpochStore, schema
from sluice.store.models import Base

#: Columns earlier releases added after the tables first shipped (all nullable).
LATER_COLUMNS = {"sluice_pipelines": ["pending_rollback"], "sluice_epochs": ["origin_generation"],
                 "sluice_source_files": ["skipped_at", "skipped_by", "skip_reason"]}


def test_migrations_build_exactly_the_models_schema(db_url):
    EpochStore(db_url).close()
    engine = create_engine(db_url)
    with engine.connect() as conn:
        assert schema.current(conn) == schema.head()
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    engine.dispose()
    # Only the version table is not a model.
    assert [d for d in diff if not (d[0] == "remove_table" and d[1].name == schema.VERSION_TABLE)] == []


def test_a_store_an_earlier_release_made_is_adopted_with_its_rows(db_url):
    engine = create_engine(db_url)
    Base.metadata.create_all(engine)  # what releases before migrations did, then without the later columns
    with engine.begin() as conn:
        for table, columns in LATER_COLUMNS.items():
            for column in columns:
                conn.execute(text(f"ALTER TABLE {table} DROP COLUMN {column}"))
        conn.execute(text("INSERT INTO sluice_pipelines (name, generation, fence, created_at) "
                          "VALUES ('old', 3, 7, '2026-01-01 00:00:00')"))
    engine.dispose()
    log = EpochStore(db_url)
    try:
        assert log.generation("old") == 3 and log.pending_rollback("old") is None
        lease = acquire_lease(log, "old", "run")
        assert lease.fence > 7, "tokens go on from the stored one"
    finally:
        log.close()
    engine = create_engine(db_url)
    with engine.connect() as conn:
        for table, columns in LATER_COLUMNS.items():
            assert set(columns) <= {c["name"] for c in inspect(conn).get_columns(table)}
        assert schema.current(conn) == schema.head()
    engine.dispose()


def _open(url: str, barrier, results) -> None:
    try:
        barrier.wait(timeout=30)
        EpochStore(url).close()
        results.put("ok")
    except Exception as exc:  # reported to the test
        results.put(f"{type(exc).__name__}: {exc}"[:500])


def test_processes_opening_a_new_store_together_migrate_it_once(db_url):
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_open, args=(db_url, barrier, results)) for _ in range(4)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert outcomes == ["ok"] * 4
    engine = create_engine(db_url)
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT version_num FROM {schema.VERSION_TABLE}")).scalars().all() == [schema.head()]
    engine.dispose()


def test_a_store_a_newer_release_migrated_is_refused(db_url):
    EpochStore(db_url).close()
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {schema.VERSION_TABLE} SET version_num = '0099_from_the_future'"))
    with pytest.raises(ProtocolError, match=r"0099_from_the_future.*newer release"):
        schema.upgrade(engine)
    engine.dispose()
