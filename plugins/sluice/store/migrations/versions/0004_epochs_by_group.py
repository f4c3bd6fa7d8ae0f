"""An index of the epochs by group: a group's epochs are read by group id.

Revision ID: 0004_epochs_by_group
Revises: 0003_source_identity
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_epochs_by_group"
down_revision: str | Sequence[str] | None = "0003_source_identity"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A store made with ``create_all`` of these models has it already.
    indexes = {i["name"] for i in sa.inspect(op.get_bind()).get_indexes("sluice_epochs")}
    if "ix_sluice_epochs_group" not in indexes:
        op.create_index("ix_sluice_epochs_group", "sluice_epochs", ["pipeline", "group_id", "epoch_id", "generation"])


def downgrade() -> None:
    op.drop_index("ix_sluice_epochs_group", table_name="sluice_epochs")
