#!/bin/bash
# Runs once, when the postgres service initialises an empty data volume
# (docker-entrypoint-initdb.d). POSTGRES_DB already created the `airflow` database for
# Airflow's metadata, owned by the `airflow` superuser. sluice keeps its epoch log in a
# database of its own (Airflow 3 forbids task code to touch the metadata DB), owned by a
# `sluice` role that is no superuser and can create neither roles nor databases.
# An existing volume does not rerun this: `docker compose down -v` to start afresh.
set -euo pipefail
: "${SLUICE_DB_PASSWORD:?SLUICE_DB_PASSWORD is not set: run make compose-env}"
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
     -v password="$SLUICE_DB_PASSWORD" <<'SQL'
CREATE ROLE sluice LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD :'password';
CREATE DATABASE sluice OWNER sluice;
SQL
