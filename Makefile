# sluice: `make demo` and `make test` do all set-up on a fresh machine (Python 3.11, Java 17).
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := $(CURDIR)/.venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
JARS := var/jars/delta-spark_4.2_2.13-4.4.0.jar var/jars/delta-storage-4.4.0.jar

# The embedded defaults: Airflow and the epoch store on SQLite under var/, Spark local[*].
export AIRFLOW_HOME ?= $(CURDIR)/var/airflow
export AIRFLOW__CORE__DAGS_FOLDER := $(CURDIR)/dags
export AIRFLOW__CORE__PLUGINS_FOLDER := $(CURDIR)/plugins
export AIRFLOW__CORE__LOAD_EXAMPLES := False
export AIRFLOW_CONN_SPARK_DEFAULT ?= {"conn_type": "spark", "host": "local[*]"}
export GX_ANALYTICS_ENABLED := false
export PYSPARK_PYTHON := $(PY)
export PATH := $(VENV)/bin:$(PATH)
export PYTHONPATH := $(CURDIR)/plugins:$(CURDIR)

.PHONY: help setup venv jars demo test lint airflow generate store-rebuild bench-control bench-control-e2e \
	bench bench-quick bench-sched clean

help:
	@echo "make demo      set up, generate YSB data, run the ysb DAG through Airflow, print results"
	@echo "make test      set up, then lint and run the whole test suite"
	@echo "make airflow   start Airflow (standalone) on http://localhost:8080 with sluice's DAGs"
	@echo "make generate  land more YSB data (RATE=, DURATION=, FILES_PER_SECOND=, SEED=, LATE=, OUT=)"
	@echo "make store-rebuild PIPELINE=<name>  rebuild a lost epoch store from the tables' epoch records"
	@echo "make bench-control  simulate the adaptive controllers on rate traces (bench/results/control.*)"
	@echo "make bench-control-e2e  the controllers on Spark, YSB at a sinusoidal rate, ~15 min (control_e2e.*)"
	@echo "make bench        YSB throughput vs Structured Streaming and batch, overheads (real Airflow), cost vs always-on"
	@echo "make bench-quick  the same, smaller and without Airflow, < 8 min (bench/results/quick/)"
	@echo "make bench-sched  concurrent epochs (A-scheduler) and Prompt partitioning on skewed keys (sched.*)"

setup: venv jars

venv: $(STAMP)
$(STAMP): requirements.txt
	@echo "==> creating/updating .venv from requirements.txt (first time: ~2 min)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip
	@$(PY) -m pip install --progress-bar on -r requirements.txt
	@touch $(STAMP)

jars: $(JARS)
$(JARS): | $(STAMP)
	@echo "==> fetching the Delta jars once into var/jars (Maven Central, via Spark's Ivy)"
	@$(PY) -m sluice.spark

demo: setup
	@$(PY) include/demo.py

test: setup lint
	@echo "==> running the test suite"
	@$(PY) -m pytest tests

lint: venv
	@$(VENV)/bin/ruff check .

airflow: setup
	@mkdir -p $(AIRFLOW_HOME)
	@echo "==> starting Airflow standalone on http://localhost:8080 (Ctrl-C stops it)"
	@echo "    login: admin / the password in $(AIRFLOW_HOME)/simple_auth_manager_passwords.json.generated"
	@echo "    (printed below on the first start as 'Password for user admin')"
	@$(VENV)/bin/airflow standalone

RATE ?= 2000
DURATION ?= 60
FILES_PER_SECOND ?= 1
SEED ?= 0
LATE ?= 0
OUT ?= var/landing/ysb
generate: venv
	@$(PY) -m include.generators.ysb --out $(OUT) --rate $(RATE) --duration $(DURATION) \
		--files-per-second $(FILES_PER_SECOND) --seed $(SEED) --late-fraction $(LATE)

store-rebuild: setup
	@test -n "$(PIPELINE)" || { echo "usage: make store-rebuild PIPELINE=<name>"; exit 2; }
	@$(PY) jobs/rebuild_store.py --pipeline $(PIPELINE)

bench-control: venv
	@$(PY) -m bench.control

bench-control-e2e: setup
	@$(PY) -m bench.control_e2e

# Spark benchmarks: JSON + PNG into bench/results/ (bench-quick: bench/results/quick/).
bench: setup
	@$(PY) -m bench.ysb
	@$(PY) -m bench.overhead
	@$(PY) -m bench.cost

bench-quick: setup
	@SLUICE_BENCH_RESULTS=$(CURDIR)/bench/results/quick $(PY) -m bench.ysb --quick
	@SLUICE_BENCH_RESULTS=$(CURDIR)/bench/results/quick $(PY) -m bench.overhead --quick --skip-airflow
	@SLUICE_BENCH_RESULTS=$(CURDIR)/bench/results/quick $(PY) -m bench.cost --quick

bench-sched: setup
	@$(PY) -m bench.sched

clean:
	rm -rf var/landing var/tables var/airflow var/sluice.db* var/demo
