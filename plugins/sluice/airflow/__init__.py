"""Airflow glue of sluice: the backlog trigger and sensor, the group operators, the DAG factory.

Triggers live here, in the plugins folder, because the triggerer imports a trigger by its
class path from its own ``sys.path``, which holds the plugins folder but not the DAG folder.
"""
