"""Attempts by outcome (failures and crashes counted apart, an open attempt marked), finished
rollbacks' records, and the versions the Asset events reported.

Revision ID: 0002_attempts_rollbacks
Revises: 0001_baseline
Create Date: 2026-11-27
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002_attempts_rollbacks"
down_revision: str | Sequence[str] | None = "0001_baseline"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A store an earlier release made with ``create_all`` of these models may have them already.
    bind = op.get_bind()
    epochs = {c["name"] for c in sa.inspect(bind).get_columns("sluice_epochs")}
    pipelines = {c["name"] for c in sa.inspect(bind).get_columns("sluice_pipelines")}
    new_epochs = [c for c in (sa.Column("failures", sa.Integer, nullable=False, server_default="0"),
                              sa.Column("crashes", sa.Integer, nullable=False, server_default="0"),
                              sa.Column("attempt_open", sa.Boolean, nullable=False, server_default=sa.false()))
                  if c.name not in epochs]
    new_pipelines = [c for c in (sa.Column("announced", sa.JSON, nullable=True),
                                 sa.Column("rebuilt_at", sa.DateTime, nullable=True)) if c.name not in pipelines]
    for column in new_epochs:
        op.add_column("sluice_epochs", column)
    for column in new_pipelines:
        op.add_column("sluice_pipelines", column)
    # An epoch of an earlier release that failed counted its failures as attempts.
    op.execute("UPDATE sluice_epochs SET failures = attempts WHERE state = 'failed'")
    if "sluice_rollbacks" not in sa.inspect(bind).get_table_names():
        op.create_table(
            "sluice_rollbacks",
            sa.Column("pipeline", sa.String(200), primary_key=True),
            sa.Column("generation", sa.Integer, primary_key=True),
            sa.Column("record", sa.JSON, nullable=False),
            sa.Column("recorded_at", sa.DateTime, nullable=False),
        )


def downgrade() -> None:
    op.drop_table("sluice_rollbacks")
    with op.batch_alter_table("sluice_pipelines") as batch:
        batch.drop_column("rebuilt_at")
        batch.drop_column("announced")
    with op.batch_alter_table("sluice_epochs") as batch:
        batch.drop_column("attempt_open")
        batch.drop_column("crashes")
        batch.drop_column("failures")
