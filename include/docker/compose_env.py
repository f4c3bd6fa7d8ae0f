"""Write ``.env`` for docker-compose.yaml with fresh random secrets (``make compose-env``).

docker-compose.yaml holds no secret of its own: the JWT and API secrets, the Fernet key, the
Postgres passwords and the first admin password come from ``.env``, and ``docker compose``
stops with the variable's name when one is missing. An existing ``.env`` is kept; only the
variables it lacks are appended.
"""

from __future__ import annotations

import base64
import os
import secrets
import sys
from pathlib import Path

#: Every variable docker-compose.yaml requires (``${NAME:?...}``), with how to make its value.
SECRETS = {
    "POSTGRES_PASSWORD": lambda: secrets.token_urlsafe(24),  # the `airflow` superuser of postgres
    "SLUICE_DB_PASSWORD": lambda: secrets.token_urlsafe(24),  # the `sluice` store user (no superuser)
    "AIRFLOW_JWT_SECRET": lambda: secrets.token_hex(32),
    "AIRFLOW_API_SECRET_KEY": lambda: secrets.token_hex(32),
    "AIRFLOW_FERNET_KEY": lambda: base64.urlsafe_b64encode(secrets.token_bytes(32)).decode(),
    "SLUICE_ADMIN_PASSWORD": lambda: secrets.token_urlsafe(12),
}


def generate() -> dict[str, str]:
    """Fresh values for every required variable, and the host user's UID for ./var's files."""
    return {"AIRFLOW_UID": str(os.getuid()), **{name: make() for name, make in SECRETS.items()}}


def read(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        name, sep, value = line.partition("=")
        if sep and not line.lstrip().startswith("#"):
            values[name.strip()] = value.strip()
    return values


def main(argv: list[str]) -> int:
    path = Path(argv[1]) if len(argv) > 1 else Path(".env")
    present = read(path)
    missing = {name: value for name, value in generate().items() if name not in present}
    if not missing:
        print(f"{path}: every variable docker-compose.yaml needs is set already")
        return 0
    with path.open("a") as out:
        if path.stat().st_size:
            out.write("\n")
        out.write("".join(f"{name}={value}\n" for name, value in missing.items()))
    path.chmod(0o600)
    print(f"{path}: added {', '.join(missing)}")
    if "SLUICE_ADMIN_PASSWORD" in missing:
        print(f"Airflow UI login: admin / the SLUICE_ADMIN_PASSWORD in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
