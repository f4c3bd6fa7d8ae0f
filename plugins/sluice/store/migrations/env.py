"""Alembic's environment for the epoch store: ``sluice.store.schema`` hands it a connection
(already in a transaction, holding the migration lock); there is no ``alembic.ini``."""

from alembic import context

from sluice.store.models import Base
from sluice.store.schema import VERSION_TABLE

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata, version_table=VERSION_TABLE,
                  render_as_batch=connection.dialect.name == "sqlite", compare_type=True)
with context.begin_transaction():
    context.run_migrations()
