"""The epoch store as it was when migrations began; adopts a store an earlier release made.

Before migrations the store was made by ``create_all`` and then by adding, at every opening,
the nullable columns newer releases had introduced. This revision does the same once, for the
last time: a table that exists gets the columns it lacks (all nullable), one that does not is
created. Later revisions are plain migrations.

Revision ID: 0001_baseline
Revises:
Create Date: 2026-11-25
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001_baseline"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _tables() -> list[sa.Table]:
    meta = sa.MetaData()
    return [
        sa.Table(
            "sluice_pipelines", meta,
            sa.Column("name", sa.String(200), primary_key=True),
            sa.Column("generation", sa.Integer, nullable=False),
            sa.Column("fence", sa.BigInteger, nullable=False),
            sa.Column("lease_owner", sa.String(500), nullable=True),
            sa.Column("lease_acquired_at", sa.DateTime, nullable=True),
            sa.Column("lease_expires_at", sa.DateTime, nullable=True),
            sa.Column("created_at", sa.DateTime, nullable=False),
            sa.Column("pending_rollback", sa.JSON, nullable=True),
        ),
        sa.Table(
            "sluice_source_files", meta,
            sa.Column("pipeline", sa.String(200), primary_key=True),
            sa.Column("position", sa.BigInteger, primary_key=True),
            sa.Column("path", sa.String(2000), nullable=False),
            sa.Column("size", sa.BigInteger, nullable=False),
            sa.Column("mtime", sa.Double, nullable=False),
            sa.Column("discovered_at", sa.DateTime, nullable=False),
            sa.Column("skipped_at", sa.DateTime, nullable=True),
            sa.Column("skipped_by", sa.String(500), nullable=True),
            sa.Column("skip_reason", sa.Text, nullable=True),
            sa.UniqueConstraint("pipeline", "path", name="uq_source_file_path"),
        ),
        sa.Table(
            "sluice_groups", meta,
            sa.Column("pipeline", sa.String(200), primary_key=True),
            sa.Column("group_id", sa.Integer, primary_key=True),
            sa.Column("owner", sa.String(500), nullable=False),
            sa.Column("fence", sa.BigInteger, nullable=False),
            sa.Column("first_epoch", sa.Integer, nullable=False),
            sa.Column("last_epoch", sa.Integer, nullable=False),
            sa.Column("state", sa.String(20), nullable=False),
            sa.Column("plan", sa.JSON, nullable=False),
            sa.Column("planned_at", sa.DateTime, nullable=False),
            sa.Column("finished_at", sa.DateTime, nullable=True),
        ),
        sa.Table(
            "sluice_epochs", meta,
            sa.Column("pipeline", sa.String(200), primary_key=True),
            sa.Column("epoch_id", sa.Integer, primary_key=True),
            sa.Column("generation", sa.Integer, primary_key=True),
            sa.Column("group_id", sa.Integer, nullable=False),
            sa.Column("start_offset", sa.BigInteger, nullable=False),
            sa.Column("end_offset", sa.BigInteger, nullable=False),
            sa.Column("state", sa.String(20), nullable=False),
            sa.Column("attempts", sa.Integer, nullable=False),
            sa.Column("delta_versions", sa.JSON, nullable=False),
            sa.Column("rows", sa.JSON, nullable=False),
            sa.Column("timings", sa.JSON, nullable=False),
            sa.Column("error", sa.Text, nullable=True),
            sa.Column("validation", sa.JSON, nullable=True),
            sa.Column("planned_at", sa.DateTime, nullable=False),
            sa.Column("committed_at", sa.DateTime, nullable=True),
            sa.Column("published_at", sa.DateTime, nullable=True),
            sa.Column("origin_generation", sa.Integer, nullable=True),
        ),
        sa.Table(
            "sluice_control", meta,
            sa.Column("pipeline", sa.String(200), primary_key=True),
            sa.Column("state", sa.JSON, nullable=False),
            sa.Column("updated_at", sa.DateTime, nullable=False),
        ),
    ]


def upgrade() -> None:
    bind = op.get_bind()
    existing = set(sa.inspect(bind).get_table_names())
    for table in _tables():
        if table.name not in existing:
            table.create(bind)
            continue
        present = {c["name"] for c in sa.inspect(bind).get_columns(table.name)}
        for column in table.columns:
            if column.name not in present:
                op.add_column(table.name, column.copy())


def downgrade() -> None:
    for table in reversed(_tables()):
        op.drop_table(table.name)
