"""What a pipeline's source was when its records were registered (a Kafka topic's ID).

Revision ID: 0003_source_identity
Revises: 0002_attempts_rollbacks
Create Date: 2026-11-27
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_source_identity"
down_revision: str | Sequence[str] | None = "0002_attempts_rollbacks"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A store made with ``create_all`` of these models has it already.
    columns = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("sluice_pipelines")}
    if "source_identity" not in columns:
        op.add_column("sluice_pipelines", sa.Column("source_identity", sa.JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sluice_pipelines") as batch:
        batch.drop_column("source_identity")
