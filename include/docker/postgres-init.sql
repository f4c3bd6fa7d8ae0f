-- Runs once, when the postgres service initialises an empty data volume
-- (docker-entrypoint-initdb.d). POSTGRES_DB already created the `airflow` database for
-- Airflow's metadata; sluice keeps its epoch log in a database of its own, because
-- Airflow 3 forbids task code to touch the metadata DB.
-- An existing volume does not rerun this: `docker compose down -v` to start afresh.
CREATE DATABASE sluice OWNER airflow;
