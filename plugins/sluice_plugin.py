"""A checkout's way to register sluice with Airflow (this plugins folder holds the package);
an installed sluice registers through its ``airflow.plugins`` entry point instead."""

from sluice.airflow.plugin import SluicePlugin

__all__ = ["SluicePlugin"]
