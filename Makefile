# sluice: `make demo` and `make test` do all set-up on a fresh machine (Python 3.11, Java 17).
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := $(CURDIR)/.venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
JARS := var/jars/delta-spark_4.2_2.13-4.4.0.jar var/jars/delta-storage-4.4.0.jar \
	var/jars/spark-sql-kafka-0-10_2.13-4.2.0.jar var/jars/spark-token-provider-kafka-0-10_2.13-4.2.0.jar \
	var/jars/kafka-clients-3.9.2.jar var/jars/commons-pool2-2.13.1.jar

# The embedded defaults: Airflow and the epoch store on SQLite under var/, Spark local[*].
export AIRFLOW_HOME ?= $(CURDIR)/var/airflow
export AIRFLOW__CORE__DAGS_FOLDER := $(CURDIR)/dags
export AIRFLOW__CORE__PLUGINS_FOLDER := $(CURDIR)/plugins
export AIRFLOW__CORE__LOAD_EXAMPLES := False
export AIRFLOW_CONN_SPARK_DEFAULT ?= {"conn_type": "spark", "host": "local[*]"}
# The api-server listens on loopback unless told otherwise (make airflow HOST=0.0.0.0 PORT=8081).
HOST ?= 127.0.0.1
PORT ?= 8080
export AIRFLOW__API__HOST := $(HOST)
export AIRFLOW__API__PORT := $(PORT)
export AIRFLOW__CORE__EXECUTION_API_SERVER_URL ?= http://$(HOST):$(PORT)/execution/
# SQLite (the embedded default) waits for its lock instead of failing "database is locked".
export AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS ?= sluice.metadata_db.CONNECT_ARGS
export AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS_ASYNC ?= sluice.metadata_db.CONNECT_ARGS_ASYNC
export GX_ANALYTICS_ENABLED := false
export PYSPARK_PYTHON := $(PY)
export PATH := $(VENV)/bin:$(PATH)
export PYTHONPATH := $(CURDIR)/plugins:$(CURDIR)

.PHONY: help setup venv jars kafka-jars demo demo-kafka demo-chain demo-cdc test test-full test-all sim system-packages lint kafka spark-cluster airflow generate store-rebuild bench-control bench-control-e2e \
	bench bench-quick bench-sched bench-store bench-large-file bench-slow-write compose-env clean backfill rollback preview-rollback recover skip-file cli

help:
	@echo "make demo      set up, generate YSB data, run the ysb DAG through Airflow, print results"
	@echo "make demo-kafka  the same over a Kafka topic (the ysb_kafka pipeline; starts a broker if none runs)"
	@echo "make demo-chain  ysb_clean, then a chained SQL pipeline on its table (hourly views per campaign)"
	@echo "make demo-cdc    Debezium-shaped change events on Kafka upserted into Delta (customers_cdc), vs an oracle"
	@echo "make test      set up, then lint and run the test suite (SQLite; the everyday loop)"
	@echo "make test-full the same plus the runs on a real Postgres server (installs it; what CI runs)"
	@echo "make sim       the deterministic simulation of the protocol (SCHEDULES=10000 SEED=<n>)"
	@echo "make airflow   start Airflow (standalone) on http://127.0.0.1:8080 with sluice's DAGs (HOST=, PORT=)"
	@echo "make backfill DAG=<dag> FROM=<date> TO=<date>  an Airflow backfill, one run at a time"
	@echo "make rollback PIPELINE=<name> TO_EPOCH=<n> REASON=<why> [RECOMPUTE=false]  trigger sluice_rollback"
	@echo "make preview-rollback PIPELINE=<name> TO_EPOCH=<n>  recompute into shadow tables, diff (changes nothing)"
	@echo "make recover PIPELINE=<name> [WITHDRAW=true]  trigger sluice_recover (rerun failed or unfinished epochs;"
	@echo "                              WITHDRAW=true first withdraws a recorded rollback whose restores never started)"
	@echo "make skip-file PIPELINE=<name> FILE=<path> REASON=<why>  skip a gone or unreadable file, recorded"
	@echo "make cli ARGS='dags list'  any airflow command with this Makefile's environment"
	@echo "make generate  land more YSB data (RATE=, DURATION=, FILES_PER_SECOND=, SEED=, LATE=, OUT=; TOPIC= for Kafka)"
	@echo "make kafka     a Kafka broker (KRaft, one node) on 127.0.0.1:9092 for the ysb_kafka pipeline"
	@echo "make spark-cluster  a Spark standalone master and two workers on 127.0.0.1"
	@echo "make store-rebuild PIPELINE=<name>  rebuild a lost epoch store from the tables' epoch records"
	@echo "make bench-control  simulate the adaptive controllers on rate traces (bench/results/control.*)"
	@echo "make bench-control-e2e  the controllers on Spark, YSB at a sinusoidal rate, ~15 min (control_e2e.*)"
	@echo "make bench        YSB throughput vs Structured Streaming and batch (files, Kafka), overheads (real Airflow), cost vs always-on"
	@echo "make bench-quick  the same, smaller and without Airflow, about 10 min (bench/results/quick/)"
	@echo "make compose-env  a .env with random secrets for docker-compose.yaml (kept if present)"
	@echo "make bench-large-file  peak memory of one 0.3/1/3 GB landed file as one epoch, 1g driver (large_file.*)"
	@echo "make bench-slow-write  a 1 GB file uploaded in place over 60 s while discovery polls: registered and read once (slow_write.*)"
	@echo "make bench-sched  concurrent epochs (A-scheduler) and Prompt partitioning on skewed keys (sched.*)"
	@echo "make bench-store  the epoch store's reads at 1k/10k/30k epochs, SQLite, under a minute (store_reads.*)"
	@echo "make docs      regenerate docs/pipeline-spec.md from the spec models (plugins/sluice/spec.py)"

# The run-once drivers' class-data archive (sluice.jvm_archive): a group's JVM starts ~5 s sooner.
JSA := var/jars/run-once-driver.jsa

setup: venv jars $(JSA)

venv: $(STAMP)
$(STAMP): requirements.txt
	@echo "==> creating/updating .venv from requirements.txt (first time: ~2 min)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip
	@$(PY) -m pip install --progress-bar on -r requirements.txt
	@touch $(STAMP)

# One stamp for the six jars one command fetches: `make -j2` runs that command once, not six times.
JARS_STAMP := var/jars/.fetched
jars: $(JARS_STAMP)
$(JARS_STAMP): | $(STAMP)
	@echo "==> fetching the Delta and Kafka-connector jars once into var/jars (Maven Central, via Spark's Ivy)"
	@$(PY) -m sluice.spark
	@touch $@

# The Kafka broker's jars (Maven), fetched in set-up: two test workers must not race to fetch them.
KAFKA_STAMP := var/jars/kafka-broker/.fetched
kafka-jars: $(KAFKA_STAMP)
$(KAFKA_STAMP): | $(STAMP)
	@echo "==> fetching the Kafka broker's jars once into var/jars/kafka-broker (Maven Central)"
	@$(PY) -c "from include.kafka.broker import fetch_jars; fetch_jars()"
	@touch $@

$(JSA): $(JARS_STAMP) $(STAMP)
	@echo "==> building the run-once drivers' class-data archive (a training run, ~40 s)"
	@$(PY) -m sluice.jvm_archive

demo: setup
	@$(PY) include/demo.py

# The same over Kafka (the ysb_kafka pipeline): the broker on $(KAFKA) if one answers, else one
# started there for the demo (data under var/kafka, as make kafka) and stopped at its end.
demo-kafka: setup
	@$(PY) include/demo.py --kafka $(KAFKA)

# Chained pipelines: ysb_clean appends views to Delta, ysb_campaign_hourly (a Delta source on
# that table, a SQL transform) sums them per campaign and hour; checked against an oracle.
demo-chain: setup
	@$(PY) include/demo.py --chain

# Change data capture: Debezium-shaped events of a customers table on $(KAFKA) (a broker started
# as for demo-kafka if none answers), the customers_cdc pipeline upserts them by id and lsn into
# Delta; the table is checked against a plain-Python replay of the topic.
demo-cdc: setup
	@$(PY) include/demo.py --cdc $(KAFKA)

# Two test workers (pytest-xdist), a test file each at a time: a module's servers start once.
WORKERS ?= 2
XDIST := -n $(WORKERS) --dist loadfile
# Where the durations and the JUnit XML of the last run are kept (docs/testing.md reads them).
CI_DIR := var/ci
REPORT = --junitxml=$(CI_DIR)/junit.xml --durations=0

# The everyday loop: everything but the runs on real servers (Postgres, Kafka), the browser, the
# fresh install, the README walk (marker acceptance), the crash points the simulation covers
# (marker spark_crash) and further variants.
test: setup lint
	@echo "==> running the test suite (without the Postgres, Kafka, browser, install and README-walk runs: make test-full)"
	@mkdir -p $(CI_DIR)
	@$(PY) -m pytest tests $(XDIST) $(REPORT) \
		-m "not postgres and not kafka and not browser and not package and not variant and not spark_crash and not acceptance"

# What CI runs: every test but further variants, with the epoch store and Airflow on a real
# Postgres server too and the Kafka source on a real broker (its jars fetched in set-up).
test-full: setup kafka-jars system-packages lint
	@echo "==> running the whole test suite (without further variants: make test-all)"
	@mkdir -p $(CI_DIR)
	@$(PY) -m pytest tests $(XDIST) $(REPORT) -m "not variant"
	@$(PY) -m tests.durations $(CI_DIR)/junit.xml --slowest 20

# Everything, the further variants of tests (marker variant) included.
test-all: setup kafka-jars system-packages lint
	@mkdir -p $(CI_DIR)
	@SLUICE_SIM_SCHEDULES=$${SLUICE_SIM_SCHEDULES:-5000} $(PY) -m pytest tests $(XDIST) $(REPORT)

# The deterministic simulation of the protocol (sluice.sim): SCHEDULES random schedules from
# SEED (default: a new one, printed), on every core; one JSON line at the end; fails on a violation.
SCHEDULES ?= 10000
sim: venv
	@$(PY) -m sluice.sim --schedules $(SCHEDULES) $(if $(filter command line environment,$(origin SEED)),--seed $(SEED))

system-packages:
	@bash include/system-packages.sh

lint: venv
	@$(VENV)/bin/ruff check .

airflow: setup
	@mkdir -p $(AIRFLOW_HOME)
	@echo "==> starting Airflow standalone on http://$(HOST):$(PORT) (Ctrl-C stops it)"
	@echo "    login: admin / the password in $(AIRFLOW_HOME)/simple_auth_manager_passwords.json.generated"
	@echo "    (printed below on the first start as 'Password for user admin')"
	@$(VENV)/bin/airflow standalone

RATE ?= 2000
DURATION ?= 60
FILES_PER_SECOND ?= 1
SEED ?= 0
LATE ?= 0
OUT ?= var/landing/ysb
# TOPIC=ysb sends the events to that Kafka topic on $(KAFKA) instead (the ysb_kafka pipeline).
TOPIC ?=
KAFKA ?= 127.0.0.1:9092
generate: venv
	@$(PY) -m include.generators.ysb $(if $(TOPIC),--topic $(TOPIC) --bootstrap $(KAFKA),--out $(OUT)) \
		--rate $(RATE) --duration $(DURATION) --files-per-second $(FILES_PER_SECOND) --seed $(SEED) \
		--late-fraction $(LATE)

# A Spark standalone cluster on 127.0.0.1 (a master and two workers, JVMs of their own, data under
# var/spark-cluster); it prints the AIRFLOW_CONN_SPARK_DEFAULT that points pipelines at it.
spark-cluster: setup
	@$(PY) -m include.spark_cluster

# A single-node Kafka broker (KRaft) on 127.0.0.1:9092, data under var/kafka; Ctrl-C stops it.
# Its jars come from Maven Central once (mvn, include/kafka/pom.xml) into var/jars/kafka-broker.
kafka: setup
	@$(PY) -m include.kafka.broker --port $(lastword $(subst :, ,$(KAFKA)))

# Airflow's CLI needs this Makefile's environment (AIRFLOW_HOME, DAG folder, plugins): use these
# targets, or `make cli ARGS='...'`, rather than a bare .venv/bin/airflow.
cli: setup
	@$(VENV)/bin/airflow $(ARGS)

# SQLite answers "database is locked" at once, whatever the busy timeout, when two writers would
# deadlock, and the scheduler may create a run for the same date a moment before a backfill does
# (IntegrityError): both are races with the scheduler, so the command is tried again a few times.
define retry_locked
for i in 1 2 3 4 5 6; do out=$$($(1) 2>&1); rc=$$?; echo "$$out" | grep -v "^$$"; \
	if [ $$rc -eq 0 ]; then exit 0; fi; \
	case "$$out" in *"database is locked"*|*IntegrityError*) echo "==> a race with the scheduler; again in 5 s ($$i/6)"; sleep 5;; \
	*) exit $$rc;; esac; done; exit 1
endef

backfill: setup
	@test -n "$(DAG)" -a -n "$(FROM)" -a -n "$(TO)" || { echo "usage: make backfill DAG=<dag> FROM=<date> TO=<date>"; exit 2; }
	@$(call retry_locked,$(VENV)/bin/airflow dags unpause $(DAG))
	@$(call retry_locked,$(VENV)/bin/airflow backfill create --dag-id $(DAG) --from-date $(FROM) --to-date $(TO) --max-active-runs 1)

TO_EPOCH ?=
REASON ?=
RECOMPUTE ?= true
# rollback and recover go through `python -m sluice` (sluice.cli), which stamps the run's conf:
# the operations DAGs refuse a bare `airflow dags trigger` (docs/operating.md, "Who may act").
rollback: setup
	@test -n "$(PIPELINE)" -a -n "$(TO_EPOCH)" -a -n "$(REASON)" || { \
		echo "usage: make rollback PIPELINE=<name> TO_EPOCH=<n> REASON=<why> [RECOMPUTE=false]"; exit 2; }
	@$(PY) -m sluice rollback --pipeline $(PIPELINE) --to-epoch $(TO_EPOCH) --reason "$(REASON)" $(if $(filter false False 0,$(RECOMPUTE)),--no-recompute)

# What that rollback (with recompute) would leave in each table, recomputed into shadow tables
# under var/previews and compared with the published ones; changes nothing (no Airflow needed).
preview-rollback: setup
	@test -n "$(PIPELINE)" -a -n "$(TO_EPOCH)" || { \
		echo "usage: make preview-rollback PIPELINE=<name> TO_EPOCH=<n>"; exit 2; }
	@$(PY) -m sluice preview-rollback --pipeline $(PIPELINE) --to-epoch $(TO_EPOCH)

recover: setup
	@test -n "$(PIPELINE)" || { echo "usage: make recover PIPELINE=<name>"; exit 2; }
	@$(PY) -m sluice recover --pipeline $(PIPELINE) $(if $(filter true True 1,$(WITHDRAW)),--withdraw-rollback)

skip-file: venv
	@test -n "$(PIPELINE)" -a -n "$(FILE)" -a -n "$(REASON)" || { \
		echo "usage: make skip-file PIPELINE=<name> FILE=<path> REASON=<why>"; exit 2; }
	@$(PY) -m sluice skip-file --pipeline $(PIPELINE) --file "$(FILE)" --reason "$(REASON)"

store-rebuild: setup
	@test -n "$(PIPELINE)" || { echo "usage: make store-rebuild PIPELINE=<name>"; exit 2; }
	@$(PY) -m sluice rebuild-store --pipeline $(PIPELINE)

bench-control: venv
	@$(PY) -m bench.control

bench-control-e2e: setup
	@$(PY) -m bench.control_e2e

# Spark benchmarks: JSON + PNG into bench/results/ (bench-quick: bench/results/quick/).
bench: setup
	@$(PY) -m bench.ysb
	@$(PY) -m bench.ysb_kafka
	@$(PY) -m bench.overhead
	@$(PY) -m bench.delta_commit
	@$(PY) -m bench.upsert
	@$(PY) -m bench.parse_cost
	@$(PY) -m bench.cost

bench-quick: setup
	@SLUICE_BENCH_RESULTS=$(CURDIR)/bench/results/quick $(PY) -m bench.ysb --quick
	@SLUICE_BENCH_RESULTS=$(CURDIR)/bench/results/quick $(PY) -m bench.ysb_kafka --quick
	@SLUICE_BENCH_RESULTS=$(CURDIR)/bench/results/quick $(PY) -m bench.overhead --quick --skip-airflow
	@SLUICE_BENCH_RESULTS=$(CURDIR)/bench/results/quick $(PY) -m bench.delta_commit --quick
	@SLUICE_BENCH_RESULTS=$(CURDIR)/bench/results/quick $(PY) -m bench.upsert --quick
	@SLUICE_BENCH_RESULTS=$(CURDIR)/bench/results/quick $(PY) -m bench.parse_cost --quick
	@SLUICE_BENCH_RESULTS=$(CURDIR)/bench/results/quick $(PY) -m bench.cost --quick

# One landed JSON-lines file of 0.3, 1 and 3 GB, each one epoch under a 1g driver: peak memory
# against a whole-file read (bench/results/large_file.*; ~5 GB of disk, ~10 min).
bench-large-file: setup
	@$(PY) -m bench.large_file

# A 1 GB file written in place over 60 s while discovery polls every 0.5 s (source.settle_s 5):
# registered once, read once, table equal to the oracle (bench/results/slow_write.*; ~4 min).
bench-slow-write: setup
	@$(PY) -m bench.slow_write

bench-sched: setup
	@$(PY) -m bench.sched

bench-store: venv
	@$(PY) -m bench.store_reads

# docs/pipeline-spec.md from the pydantic models of plugins/sluice/spec.py (tests/unit/test_spec_reference.py
# fails when the committed file differs). Phony: docs/ is a folder.
.PHONY: docs
docs: venv
	@$(PY) -m include.spec_reference

# docker-compose.yaml's secrets: a .env with fresh random values (an existing .env is kept).
compose-env:
	@python3 include/docker/compose_env.py .env

clean:
	rm -rf var/landing var/tables var/airflow var/sluice.db* var/demo var/kafka
