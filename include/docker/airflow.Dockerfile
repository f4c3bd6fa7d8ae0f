# sluice image for docker-compose.yaml: Airflow 3.3.2 on Python 3.11, plus Java 17 and the
# project's pinned Python stack (pyspark, delta-spark, great-expectations, ...).
#
# One image serves every container of the stack: the Airflow components *and* the Spark
# standalone master/worker. Spark is the copy pip installs with pyspark, so the cluster runs
# exactly the pinned Spark version, executors run the same Python 3.11 with the same packages
# as the driver (Python workers refuse a different minor version than the driver's), and all
# containers share one UID/GID (AIRFLOW_UID:0), so files any of them writes under ./var
# (Delta tables, checkpoints, logs) can be rewritten and deleted by all the others.
#
# Built by compose with the repository root as context (requirements.txt lives there);
# airflow.Dockerfile.dockerignore next to this file keeps everything else out of the context.
FROM apache/airflow:3.3.2-python3.11

USER root
# Java 17 for the Spark driver (it runs inside the Airflow task processes) and for the
# Spark master/worker. The man1 folder works around openjdk's postinst on slim Debian images.
# /usr/lib/jvm/default-java is an architecture-independent JAVA_HOME (amd64 and arm64).
RUN set -eux; \
    mkdir -p /usr/share/man/man1; \
    apt-get update; \
    apt-get install -y --no-install-recommends openjdk-17-jre-headless; \
    ln -sfn "$(dirname "$(dirname "$(readlink -f "$(command -v java)")")")" /usr/lib/jvm/default-java; \
    apt-get autoremove -yqq --purge; \
    apt-get clean; \
    rm -rf /var/lib/apt/lists/*
ENV JAVA_HOME=/usr/lib/jvm/default-java

USER airflow
COPY --chown=airflow:0 requirements.txt /requirements.txt
# Pinning apache-airflow to the base image's version stops pip from moving Airflow itself.
RUN pip install --no-cache-dir "apache-airflow==${AIRFLOW_VERSION}" -r /requirements.txt

# A fixed SPARK_HOME pointing at the pip-installed Spark (bin/, jars/), so that
# /opt/spark/bin/spark-class starts the standalone master/worker and spark-submit
# (SparkSubmitOperator) finds the same installation.
USER root
RUN ln -sfn "$(python -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')" /opt/spark \
    && test -x /opt/spark/bin/spark-class
ENV SPARK_HOME=/opt/spark
USER airflow
