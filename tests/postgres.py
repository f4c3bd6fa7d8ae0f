"""A real PostgreSQL server for the tests: Debian's binaries (``make test`` installs them), a
throwaway data directory, listening on 127.0.0.1 only, with password authentication over TCP.

The tests get what a deployment has (see ``include/docker/postgres-init.sh``): an ``airflow``
database for Airflow's metadata and a ``sluice`` database for the epoch store, each owned by a
role that is not a superuser. ``database()`` makes a fresh, empty one for a test that needs it.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from sluice.net import free_port

SUPERUSER = "postgres"
OWNER = "sluice"
AIRFLOW_OWNER = "airflow"


def _bin_dir() -> Path:
    """The newest installed server's ``bin`` folder (Debian keeps initdb off PATH)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).parent
    raise RuntimeError("no PostgreSQL server installed: `make test` installs Debian's postgresql-15 "
                       "(include/system-packages.sh); or apt-get install postgresql-15")


@dataclass
class PostgresServer:
    root: Path
    port: int
    password: str

    @classmethod
    def start(cls) -> PostgresServer:
        bin_dir = _bin_dir()
        # The server refuses to run as root: as root, run it as Debian's `postgres` user.
        as_user = ["runuser", "-u", SUPERUSER, "--"] if os.geteuid() == 0 else []
        root = Path(tempfile.mkdtemp(prefix="sluice-pg-"))
        if as_user:
            entry = pwd.getpwnam(SUPERUSER)
            os.chown(root, entry.pw_uid, entry.pw_gid)
        password = uuid.uuid4().hex
        pwfile = root / "pw"
        pwfile.write_text(password + "\n")
        if as_user:
            os.chown(pwfile, entry.pw_uid, entry.pw_gid)
        server = cls(root=root, port=free_port(), password=password)

        def run(*args: str) -> None:
            done = subprocess.run([*as_user, *args], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
                                   f"\n{server.log_tail()}")

        run(str(bin_dir / "initdb"), "-D", str(root / "data"), "-U", SUPERUSER, f"--pwfile={pwfile}",
            "--auth-host=scram-sha-256", "--auth-local=peer", "-E", "UTF8", "--no-sync")
        (root / "run").mkdir()
        if as_user:
            os.chown(root / "run", entry.pw_uid, entry.pw_gid)
        # fsync off: the tests kill clients (Spark jobs, Airflow tasks), never this server.
        options = (f"-c listen_addresses=127.0.0.1 -p {server.port} -k {root / 'run'} -c fsync=off "
                   "-c max_connections=300")
        run(str(bin_dir / "pg_ctl"), "-D", str(root / "data"), "-l", str(root / "server.log"), "-o", options,
            "-w", "-t", "60", "start")
        for role, db in ((OWNER, "sluice"), (AIRFLOW_OWNER, "airflow")):
            server.sql(f"CREATE ROLE {role} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD '{password}'")
            server.sql(f"CREATE DATABASE {db} OWNER {role}")
        return server

    def log_tail(self, lines: int = 40) -> str:
        log = self.root / "server.log"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""

    def url(self, database: str = "sluice", role: str = OWNER, driver: str = "psycopg2") -> str:
        return f"postgresql+{driver}://{role}:{self.password}@127.0.0.1:{self.port}/{database}"

    def sql(self, statement: str, database: str = "postgres") -> None:
        """Run one statement as the superuser (over TCP, with the password)."""
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=self.port, user=SUPERUSER, password=self.password,
                                dbname=database)
        conn.autocommit = True
        try:
            with conn.cursor() as cursor:
                cursor.execute(statement)
        finally:
            conn.close()

    def database(self, owner: str = OWNER) -> str:
        """A new, empty database owned by ``owner``; its URL."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        self.sql(f"CREATE DATABASE {name} OWNER {owner}")
        return self.url(name, owner)

    def stop(self) -> None:
        as_user = ["runuser", "-u", SUPERUSER, "--"] if os.geteuid() == 0 else []
        subprocess.run([*as_user, str(_bin_dir() / "pg_ctl"), "-D", str(self.root / "data"), "-m", "immediate",
                        "-w", "stop"], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)
