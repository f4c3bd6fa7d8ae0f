"""Static checks of docker-compose.yaml and the image it builds.

No Docker engine is needed (or used): the compose file is read with PyYAML, which resolves
the `<<` merge keys and anchors the file relies on, and the assertions compare services,
commands, environments and mounts with each other and with the repository's files.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "include" / "docker"))
import compose_env  # noqa: E402

COMPOSE_FILE = ROOT / "docker-compose.yaml"

AIRFLOW_SERVICES = (
    "airflow-init",
    "airflow-apiserver",
    "airflow-scheduler",
    "airflow-dag-processor",
    "airflow-triggerer",
)
SPARK_SERVICES = ("spark-master", "spark-worker")
REQUIRED_SERVICES = ("postgres", *AIRFLOW_SERVICES, *SPARK_SERVICES)

# Long-running Airflow components and the `airflow` sub-command each one must run.
AIRFLOW_COMMANDS = {
    "airflow-apiserver": "api-server",
    "airflow-scheduler": "scheduler",
    "airflow-dag-processor": "dag-processor",
    "airflow-triggerer": "triggerer",
}

# Project folder -> where the Airflow containers and the Spark worker must see it.
PROJECT_MOUNTS = {
    "dags": "/opt/sluice/dags",
    "plugins": "/opt/sluice/plugins",
    "jobs": "/opt/sluice/jobs",
    "include": "/opt/sluice/include",
    "var": "/opt/sluice/var",
}
DATA_DIR = "var"  # git-ignored; may be absent in a fresh clone (docker creates it)


# --------------------------------------------------------------------------- helpers


# compose's interpolation: ${NAME}, ${NAME:-default}, ${NAME:?error}; $$ is a literal $.
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::([-?])([^}]*))?\}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """``text`` as ``docker compose config`` resolves it with ``env`` (the .env file)."""
    def value(match: re.Match) -> str:
        name, op, arg = match.groups()
        if env.get(name):
            return env[name]
        if op == "?":
            raise KeyError(f"required variable {name} is missing a value: {arg}")
        return arg if op == "-" else ""
    return _VAR.sub(value, text.replace("$$", "\0")).replace("\0", "$")


#: What `make compose-env` writes into .env.
DOT_ENV = compose_env.generate()


@pytest.fixture(scope="module")
def compose() -> dict:
    """The compose file as compose resolves it with a .env from `make compose-env`."""
    assert COMPOSE_FILE.is_file(), f"{COMPOSE_FILE} is missing"
    data = yaml.safe_load(interpolate(COMPOSE_FILE.read_text(), DOT_ENV))
    assert isinstance(data, dict) and isinstance(data.get("services"), dict), (
        "docker-compose.yaml must be a mapping with a `services:` mapping"
    )
    return data


@pytest.fixture(scope="module")
def services(compose: dict) -> dict:
    return compose["services"]


def _env(service: dict) -> dict[str, str]:
    """A service's environment as a dict, whichever of the two compose syntaxes it uses."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def _command(service: dict) -> list[str]:
    cmd = service.get("command")
    if cmd is None:
        return []
    return cmd.split() if isinstance(cmd, str) else [str(part) for part in cmd]


def _command_text(service: dict) -> str:
    """Entry point and command as one string, for `in` checks on shell scripts."""
    entry = service.get("entrypoint") or []
    entry = [entry] if isinstance(entry, str) else list(entry)
    return " ".join([*map(str, entry), *_command(service)])


def _mounts(service: dict) -> list[tuple[str, str]]:
    """(source, target) of every volume of a service, short or long syntax."""
    out = []
    for vol in service.get("volumes") or []:
        if isinstance(vol, dict):
            out.append((str(vol.get("source", "")), str(vol["target"])))
        else:
            parts = str(vol).split(":")
            if len(parts) == 1:  # anonymous volume: container path only
                out.append(("", parts[0]))
            else:
                out.append((parts[0], parts[1]))
    return out


def _bind_mounts(service: dict) -> dict[str, str]:
    """Host-relative bind mounts of a service: normalised host path -> container path."""
    binds = {}
    for source, target in _mounts(service):
        if source.startswith("."):
            binds[pathlib.PurePosixPath(source).as_posix().removeprefix("./")] = target
    return binds


def _published_container_ports(service: dict) -> set[int]:
    ports = set()
    for port in service.get("ports") or []:
        if isinstance(port, dict):
            if port.get("published") is not None:
                ports.add(int(port["target"]))
        else:
            parts = str(port).split("/")[0].split(":")
            if len(parts) >= 2:  # "HOST:CONTAINER" or "IP:HOST:CONTAINER"
                ports.add(int(parts[-1]))
    return ports


def _depends_on(service: dict) -> dict:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return {name: {"condition": "service_started"} for name in deps}
    return deps


def _requirement_pin(name: str) -> str:
    """The `==` version pinned for a distribution in requirements.txt."""
    req = ROOT / "requirements.txt"
    assert req.is_file(), "requirements.txt is missing at the repository root"
    for line in req.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*==\s*([^\s;]+)", line)
        if m and m.group(1).lower().replace("_", "-") == name:
            return m.group(2)
    raise AssertionError(f"requirements.txt does not pin {name}==<version>")


def _dockerfile(service: dict) -> tuple[pathlib.Path, pathlib.Path]:
    """(context dir, Dockerfile path) of a service's `build:`."""
    build = service.get("build")
    assert build, "service has no `build:`"
    if isinstance(build, str):
        context, dockerfile = build, "Dockerfile"
    else:
        context, dockerfile = build.get("context", "."), build.get("dockerfile", "Dockerfile")
    context_dir = (ROOT / context).resolve()
    return context_dir, (context_dir / dockerfile).resolve()


def _db_url(url: str, what: str):
    parts = urlsplit(url)
    assert parts.scheme.startswith("postgresql"), f"{what} should be a Postgres URL, got {url!r}"
    return parts


# ----------------------------------------------------------------------------- tests


def test_required_services_exist(services):
    missing = [name for name in REQUIRED_SERVICES if name not in services]
    assert not missing, f"docker-compose.yaml lacks services {missing}; it has {sorted(services)}"


@pytest.mark.parametrize("name", sorted(AIRFLOW_COMMANDS))
def test_airflow_component_runs_its_command(services, name):
    cmd = _command(services[name])
    if cmd[:1] == ["airflow"]:  # `airflow scheduler` and `scheduler` are the same to the image
        cmd = cmd[1:]
    assert cmd[:1] == [AIRFLOW_COMMANDS[name]], (
        f"{name} should run `airflow {AIRFLOW_COMMANDS[name]}`, "
        f"its command is {services[name].get('command')!r}"
    )


def test_airflow_init_migrates_the_metadata_db(services):
    text = _command_text(services["airflow-init"])
    assert re.search(r"\bairflow db migrate\b", text), (
        f"airflow-init should run `airflow db migrate`; it runs: {text!r}"
    )
    for name in AIRFLOW_COMMANDS:
        dep = _depends_on(services[name]).get("airflow-init")
        assert dep and dep.get("condition") == "service_completed_successfully", (
            f"{name} must wait for airflow-init with condition service_completed_successfully, "
            f"got {dep!r}"
        )
    assert "airflow-init" not in _depends_on(services["airflow-init"]), (
        "airflow-init depends on itself (an anchor's depends_on was not overridden)"
    )


@pytest.mark.parametrize("name", AIRFLOW_SERVICES)
def test_airflow_service_core_settings(services, name):
    env = _env(services[name])
    expected = {
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": "http://airflow-apiserver:8080/execution/",
        "SLUICE_HOME": "/opt/sluice",
        "SLUICE_DATA_DIR": "/opt/sluice/var",
    }
    for key, value in expected.items():
        assert env.get(key) == value, f"{name}: {key} should be {value!r}, got {env.get(key)!r}"


def test_airflow_services_share_databases_and_secrets(services):
    shared = (
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
        "SLUICE_STORE_URL",
        "AIRFLOW__API_AUTH__JWT_SECRET",
        "AIRFLOW__API__SECRET_KEY",
        "AIRFLOW__CORE__FERNET_KEY",
        "AIRFLOW_CONN_SPARK_DEFAULT",
    )
    for key in shared:
        values = {name: _env(services[name]).get(key) for name in AIRFLOW_SERVICES}
        assert all(values.values()), (
            f"{key} must be set (non-empty) in every Airflow service: {values}"
        )
        assert len(set(values.values())) == 1, (
            f"{key} differs between Airflow services (JWTs/DB rows written by one component "
            f"must be readable by the others): {values}"
        )


def test_database_urls_point_at_the_postgres_service(services):
    env = _env(services["airflow-scheduler"])
    pg_env = _env(services["postgres"])
    meta = _db_url(
        env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"], "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"
    )
    store = _db_url(env["SLUICE_STORE_URL"], "SLUICE_STORE_URL")
    for what, url in (("metadata DB", meta), ("sluice store", store)):
        assert url.hostname in services, (
            f"the {what} URL names host {url.hostname!r}, which is not a service of the stack"
        )
        assert url.hostname == "postgres", f"the {what} should live on the postgres service"
    assert (meta.username, meta.password) == (pg_env.get("POSTGRES_USER"), pg_env.get("POSTGRES_PASSWORD")), (
        "the metadata DB URL's credentials do not match POSTGRES_USER/POSTGRES_PASSWORD"
    )
    # The store's own role, made by the init script with the password postgres was given for it.
    assert (store.username, store.password) == ("sluice", pg_env.get("SLUICE_DB_PASSWORD")), (
        "the sluice store URL must log in as the `sluice` role with SLUICE_DB_PASSWORD"
    )
    assert meta.path == "/airflow" and meta.path.lstrip("/") == pg_env.get("POSTGRES_DB"), (
        f"Airflow metadata should use the `airflow` database (POSTGRES_DB), got {meta.path!r}"
    )
    assert store.path == "/sluice", (
        f"SLUICE_STORE_URL must use its own `sluice` database, never Airflow's; got {store.path!r}"
    )


def test_postgres_service(compose, services):
    pg = services["postgres"]
    assert str(pg.get("image", "")).startswith("postgres:16"), (
        f"postgres image should be postgres:16, got {pg.get('image')!r}"
    )
    test = pg.get("healthcheck", {}).get("test")
    test_text = " ".join(test) if isinstance(test, list) else str(test)
    assert "pg_isready" in test_text, f"postgres needs a pg_isready healthcheck, has {test!r}"

    named = [src for src, target in _mounts(pg) if target == "/var/lib/postgresql/data"]
    assert named and named[0] in (compose.get("volumes") or {}), (
        "postgres data must live in a named volume declared under top-level `volumes:`"
    )

    init_sources = [
        src for src, target in _mounts(pg) if target.startswith("/docker-entrypoint-initdb.d")
    ]
    assert init_sources, "postgres must mount an init script into /docker-entrypoint-initdb.d"
    sql = "\n".join((ROOT / src).read_text() for src in init_sources if (ROOT / src).is_file())
    assert re.search(r"create\s+database\s+\"?sluice\b", sql, re.IGNORECASE), (
        f"no mounted init script ({init_sources}) creates the `sluice` database"
    )


def test_apiserver_publishes_8080(services):
    ports = _published_container_ports(services["airflow-apiserver"])
    assert 8080 in ports, (
        f"airflow-apiserver must publish container port 8080, publishes {sorted(ports)}"
    )
    api_url = urlsplit(
        _env(services["airflow-scheduler"])["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"]
    )
    assert api_url.hostname in services and api_url.port == 8080, (
        "the execution API URL must name the api-server service on port 8080, "
        f"got {api_url.geturl()!r}"
    )


@pytest.mark.parametrize("name", (*AIRFLOW_SERVICES, "spark-worker"))
def test_project_folders_mounted_at_the_same_paths(services, name):
    binds = _bind_mounts(services[name])
    for folder, target in PROJECT_MOUNTS.items():
        assert binds.get(folder) == target, (
            f"{name} must mount ./{folder} at {target} (driver and executors need one view of the "
            f"files); it mounts {binds}"
        )


def test_host_paths_exist(services):
    for name, service in services.items():
        for source, target in _mounts(service):
            if not source.startswith((".", "/", "~")):
                continue  # named or anonymous volume
            assert source.startswith("."), (
                f"{name} mounts the absolute host path {source!r}; use a path inside the repository"
            )
            rel = pathlib.PurePosixPath(source.removeprefix("./"))
            if rel.parts[:1] == (DATA_DIR,):
                continue  # git-ignored data folder, created on demand
            assert (ROOT / rel).exists(), (
                f"{name} mounts ./{rel} (at {target}), which does not exist in the repository"
            )


def test_named_volumes_are_declared(compose, services):
    declared = set(compose.get("volumes") or {})
    for name, service in services.items():
        for source, _target in _mounts(service):
            if source and not source.startswith((".", "/", "~", "$")):
                assert source in declared, (
                    f"{name} uses volume {source!r}, not declared under `volumes:`"
                )


@pytest.mark.parametrize("name", AIRFLOW_SERVICES)
def test_folder_settings_match_the_mounts(services, name):
    env, binds = _env(services[name]), _bind_mounts(services[name])
    assert env.get("AIRFLOW__CORE__PLUGINS_FOLDER") == binds.get("plugins"), (
        f"{name}: AIRFLOW__CORE__PLUGINS_FOLDER={env.get('AIRFLOW__CORE__PLUGINS_FOLDER')!r} "
        f"is not where ./plugins is mounted ({binds.get('plugins')!r})"
    )
    assert env.get("AIRFLOW__CORE__DAGS_FOLDER") == binds.get("dags"), (
        f"{name}: AIRFLOW__CORE__DAGS_FOLDER={env.get('AIRFLOW__CORE__DAGS_FOLDER')!r} "
        f"is not where ./dags is mounted ({binds.get('dags')!r})"
    )
    assert env.get("SLUICE_DATA_DIR") == binds.get(DATA_DIR), (
        f"{name}: SLUICE_DATA_DIR is not where ./var is mounted"
    )
    pythonpath = env.get("PYTHONPATH", "").split(":")
    assert binds.get("plugins") in pythonpath, (
        f"{name}: PYTHONPATH {pythonpath} must contain the plugins mount so `import sluice` works"
    )


def test_depends_on_only_defined_services(services):
    for name, service in services.items():
        for dep in _depends_on(service):
            assert dep in services, f"{name} depends on {dep!r}, which is not a service"


def test_spark_cluster_wiring(services):
    master = " ".join(_command(services["spark-master"]))
    worker = " ".join(_command(services["spark-worker"]))
    assert "org.apache.spark.deploy.master.Master" in master, f"spark-master runs {master!r}"
    assert "org.apache.spark.deploy.worker.Worker" in worker, f"spark-worker runs {worker!r}"
    assert "spark://spark-master:7077" in worker, (
        f"spark-worker must register at spark://spark-master:7077: {worker!r}"
    )
    assert {7077, 8081} <= _published_container_ports(services["spark-master"]), (
        "spark-master should publish 7077 (master) and 8081 (web UI)"
    )

    conn = json.loads(_env(services["airflow-scheduler"])["AIRFLOW_CONN_SPARK_DEFAULT"])
    host = urlsplit(conn["host"])
    assert conn.get("conn_type") == "spark" and host.scheme == "spark", (
        f"AIRFLOW_CONN_SPARK_DEFAULT should be a spark:// connection, got {conn}"
    )
    assert host.hostname in services and int(conn.get("port", 0)) == 7077, (
        f"AIRFLOW_CONN_SPARK_DEFAULT should point at the spark-master service on 7077, got {conn}"
    )


def test_spark_version_matches_pyspark(services):
    """Driver (pyspark in the Airflow image) and cluster must run one Spark version."""
    pyspark = _requirement_pin("pyspark")
    airflow_dockerfile = _dockerfile(services["airflow-scheduler"])[1]
    for name in SPARK_SERVICES:
        service = services[name]
        image = str(service.get("image", ""))
        if service.get("build"):
            assert _dockerfile(service)[1] == airflow_dockerfile, (
                f"{name} builds from a different Dockerfile than Airflow; "
                f"it would not run pyspark {pyspark}"
            )
        else:
            assert image.startswith(f"apache/spark:{pyspark}-"), (
                f"{name} runs {image!r}, but the driver uses pyspark {pyspark}"
            )


def test_dockerfile_installs_java_and_requirements(services):
    seen = set()
    for name in (*AIRFLOW_SERVICES, *SPARK_SERVICES):
        if not services[name].get("build"):
            continue
        context, dockerfile = _dockerfile(services[name])
        if dockerfile in seen:
            continue
        seen.add(dockerfile)
        assert dockerfile.is_file(), f"{name}: build.dockerfile {dockerfile} does not exist"
        text = dockerfile.read_text()
        base = re.search(r"^FROM\s+(\S+)", text, re.MULTILINE)
        airflow = _requirement_pin("apache-airflow")
        assert base and base.group(1) == f"apache/airflow:{airflow}-python3.11", (
            f"{dockerfile.name} should build FROM apache/airflow:{airflow}-python3.11 "
            f"(the apache-airflow pin), got {base and base.group(1)!r}"
        )
        assert re.search(r"apt-get install[^\n]*openjdk-17-jre-headless", text), (
            f"{dockerfile.name} must apt-get install openjdk-17-jre-headless (Spark needs Java 17)"
        )
        copy = re.search(r"^COPY\s+(?:--\S+\s+)*(\S*requirements\.txt)\s+(\S+)", text, re.MULTILINE)
        assert copy, f"{dockerfile.name} must COPY requirements.txt into the image"
        assert (context / copy.group(1)).is_file(), (
            f"{dockerfile.name} copies {copy.group(1)}, which is not in the build context {context}"
        )
        assert re.search(rf"pip install[^\n]*-r\s+{re.escape(copy.group(2))}", text), (
            f"{dockerfile.name} must `pip install -r {copy.group(2)}`"
        )
    assert seen, "no service builds the sluice image (`build:` missing)"


# ----------------------------------------------------------------- secrets and exposure


#: What must be secret, listed here rather than taken from ``compose_env.SECRETS`` (the list
#: under test): each a required variable of .env, without a default, that `make compose-env` makes.
MUST_BE_SECRET = {"POSTGRES_PASSWORD", "SLUICE_DB_PASSWORD", "AIRFLOW_JWT_SECRET", "AIRFLOW_API_SECRET_KEY",
                  "AIRFLOW_FERNET_KEY", "SLUICE_ADMIN_PASSWORD"}
#: A variable or setting named like this holds a secret (a ``..._FILE`` setting holds a path).
SECRET_NAME = re.compile(r"PASSWORD|PASSWD|SECRET|KEY|TOKEN|CREDENTIAL|PRIVATE", re.IGNORECASE)
_REQUIRED = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*):\?[^}]*\}")


def _secret_uses(text: str) -> dict[str, set[str]]:
    """Every variable named like a secret in ``text``, with how each use reads it (``:?``, ``:-``...)."""
    uses: dict[str, set[str]] = {}
    for name, op in re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:?[-?]?)[^}]*\}", text):
        if SECRET_NAME.search(name):
            uses.setdefault(name, set()).add(op)
    return uses


def _settings_holding_secrets(compose: dict) -> dict[str, str]:
    """``service.KEY`` -> the value as written (not interpolated) of every environment setting
    that holds a secret: named like one, or a URL with a password."""
    found = {}
    for name, service in compose["services"].items():
        for key, value in _env(service).items():
            if (SECRET_NAME.search(key) and not key.endswith("_FILE")) or urlsplit(value).password:
                found[f"{name}.{key}"] = value
    return found


def test_no_secret_has_a_default_and_each_comes_from_dot_env(services):
    text = COMPOSE_FILE.read_text()
    uses = _secret_uses(text)
    assert set(uses) <= MUST_BE_SECRET, f"secrets not listed in MUST_BE_SECRET: {sorted(set(uses) - MUST_BE_SECRET)}"
    assert set(compose_env.SECRETS) == MUST_BE_SECRET, "`make compose-env` must generate exactly these"
    for name in MUST_BE_SECRET:
        assert uses.get(name) == {":?"}, f"{name} must be a required variable (${{{name}:?...}}): {uses.get(name)}"
        without = {k: v for k, v in DOT_ENV.items() if k != name}
        with pytest.raises(KeyError, match=name):
            interpolate(text, without)
    raw = yaml.safe_load(text)  # as written: a literal secret is not hidden by interpolation
    for setting, value in _settings_holding_secrets(raw).items():
        secret = urlsplit(value).password if "://" in value else value
        match = _REQUIRED.fullmatch(secret or "")
        assert match and match.group(1) in MUST_BE_SECRET, (
            f"{setting} holds a secret that is not a required variable of MUST_BE_SECRET: {value!r}")
    resolved = json.dumps(services)
    for name in MUST_BE_SECRET:
        assert DOT_ENV[name] in resolved, f"{name} from .env does not reach the services"
    for literal in ("airflow:airflow@", "admin:admin@", "l801u5aulnBmUxqyLDn4rvmDiXHmMFwJes4AVsXZ74Y="):
        assert literal not in text, f"a default secret is still written in docker-compose.yaml: {literal}"


def test_ports_are_published_on_loopback_unless_configured(services):
    published = {name: [str(p) for p in svc.get("ports") or []] for name, svc in services.items()}
    assert any(published.values())
    for name, ports in published.items():
        assert all(p.startswith("127.0.0.1:") for p in ports), f"{name} publishes beyond loopback: {ports}"
    everywhere = yaml.safe_load(interpolate(COMPOSE_FILE.read_text(), {**DOT_ENV, "SLUICE_BIND_ADDRESS": "0.0.0.0"}))
    assert "0.0.0.0:8080:8080" in everywhere["services"]["airflow-apiserver"]["ports"]
    # Spark's standalone master has no authentication: whoever reaches it runs code.
    assert everywhere["services"]["spark-master"]["ports"] == ["127.0.0.1:7077:7077", "127.0.0.1:8081:8081"]


def test_the_store_user_is_no_superuser(services):
    sources = [src for src, target in _mounts(services["postgres"]) if target.startswith("/docker-entrypoint-initdb.d")]
    script = "\n".join((ROOT / src).read_text() for src in sources)
    role = re.search(r"CREATE ROLE sluice ([^;]*);", script)
    assert role and {"LOGIN", "NOSUPERUSER", "NOCREATEDB", "NOCREATEROLE"} <= set(role.group(1).split()), script
    assert re.search(r"CREATE DATABASE sluice OWNER sluice;", script), script
    assert "SLUICE_DB_PASSWORD" in script and "password" in role.group(1).lower()


def test_compose_env_writes_every_secret_once_and_keeps_what_is_there(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("AIRFLOW_UID=1234\nPOSTGRES_PASSWORD=mine\n")
    assert compose_env.main(["compose_env", str(env_file)]) == 0
    first = compose_env.read(env_file)
    assert first["AIRFLOW_UID"] == "1234" and first["POSTGRES_PASSWORD"] == "mine"
    assert set(compose_env.SECRETS) <= set(first) and all(first.values())
    assert env_file.stat().st_mode & 0o077 == 0, "the .env file must be readable by its owner only"
    assert compose_env.main(["compose_env", str(env_file)]) == 0
    assert compose_env.read(env_file) == first, "a second run must change nothing"
    other = tmp_path / "other.env"
    compose_env.main(["compose_env", str(other)])
    assert compose_env.read(other)["AIRFLOW_JWT_SECRET"] != first["AIRFLOW_JWT_SECRET"], "secrets are random"
