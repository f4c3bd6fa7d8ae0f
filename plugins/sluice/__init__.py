"""sluice: discontinuous stream processing on Airflow, Spark and Delta Lake.

Data piles up at a source; Airflow releases it in measured micro-batches (epochs), a group of
them per run-once Spark application, with exactly-once output to Delta.
"""

__version__ = "0.1.0"
