"""The epoch API behind Airflow's auth, on a real ``airflow api-server`` (simple auth manager,
three users): no token 401, a user without DAG access 403, a viewer 200 with what the store
holds; the UI's session cookie works like the Bearer header. Plugin apps are mounted outside
the core API's auth, so this is the plugin's own doing."""

from __future__ import annotations

import json
import secrets
import subprocess
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.protocol.leases import acquire_lease
from sluice.protocol.planning import plan_group
from sluice.store import EpochStore
from tests.airflow import standalone
from tests.pipelines import make_pipeline

#: user -> role of the simple auth manager ("": a user with no role, so no access to any DAG).
USERS = {"admin": "admin", "viewer": "viewer", "nobody": ""}
ROUTES = ("/sluice/pipelines/{p}/epochs", "/sluice/pipelines/{p}/control", "/sluice/pipelines/{p}/groups",
          "/sluice/pipelines/{p}/rollback-preview?to_epoch=0", "/sluice/pipelines/{p}/shadow-previews",
          "/sluice/ui/{p}")


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> Iterator[tuple[standalone.Server, dict[str, str]]]:
    """``airflow api-server`` alone (no scheduler needed to serve the API), with the users'
    passwords in a file; yields it with a token per user, each from ``POST /auth/token``."""
    home = tmp_path_factory.mktemp("api_auth") / "airflow"
    home.mkdir(parents=True)
    passwords = {user: secrets.token_urlsafe(12) for user in USERS}
    (home / "passwords.json").write_text(json.dumps(passwords))
    env = {"AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
           "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join(f"{u}:{r}" for u, r in USERS.items()),
           "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json")}
    migrate = subprocess.run([standalone.airflow_command(), "db", "migrate"], capture_output=True, text=True,
                             env={**standalone.server_env(home, 0), **env}, cwd=home, timeout=300)
    assert migrate.returncode == 0, migrate.stdout[-2000:] + migrate.stderr[-2000:]
    server = standalone.start(home, ("api-server",), env)
    try:
        with httpx.Client(base_url=server.url, timeout=30.0) as client:
            standalone.wait_for(lambda: _up(client), 180, "the api-server to answer", server=server)
            tokens = {}
            for user, password in passwords.items():
                r = client.post("/auth/token", json={"username": user, "password": password})
                assert r.status_code in (200, 201), r.text
                tokens[user] = r.json()["access_token"]
        yield server, tokens
    finally:
        standalone.stop(server)


def _up(client: httpx.Client) -> bool:
    try:
        return client.get("/api/v2/version").status_code in (200, 401)
    except httpx.TransportError:
        return False


def test_every_route_needs_a_user_with_read_access_to_the_pipeline_dag(api):
    server, tokens = api
    spec = make_pipeline("auth_probe")
    log = EpochStore()
    landed = spec.landing_dir / "a.json"
    landed.write_text("{}\n")
    lease = acquire_lease(log, spec.name, "t")
    log.register_files(spec.name, [(str(landed), landed.stat().st_size, landed.stat().st_mtime)])
    plan_group(log, lease, epoch_size=1, k=1)
    (spec.landing_dir / "b.json").write_text("{}\n")
    log.close()

    def get(path: str, user: str | None = None, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {tokens[user]}"} if user else {}
        with httpx.Client(base_url=server.url, timeout=30.0) as client:
            return client.get(path, headers=headers, **kw)

    for route in (*ROUTES, "/sluice/pipelines", "/sluice/ui"):
        path = route.format(p=spec.name)
        assert get(path).status_code == 401, path
        with httpx.Client(base_url=server.url, timeout=30.0) as client:
            forged = client.get(path, headers={"Authorization": "Bearer not-a-token"})
        assert forged.status_code in (401, 403), (path, forged.status_code)
    for route in ROUTES:
        assert get(route.format(p=spec.name), "nobody").status_code == 403
        assert get(route.format(p="no_such_pipeline")).status_code == 401  # nothing said before a login
    assert get("/sluice/pipelines", "nobody").json() == []  # a list of the pipelines it may read: none

    epochs = get(f"/sluice/pipelines/{spec.name}/epochs", "viewer")
    assert epochs.status_code == 200, epochs.text
    assert [(e["epoch_id"], e["start"], e["end"], e["state"]) for e in epochs.json()] == [(0, 0, 1, "planned")]
    assert [f["path"] for f in epochs.json()[0]["files"]] == [str(spec.landing_dir / "a.json")]
    # Pages: the last epoch id, none below epoch 0; a count past 64 bits is refused, not a 500.
    assert get(f"/sluice/pipelines/{spec.name}/epochs", "viewer", params={"last": 1}).json() == epochs.json()
    assert get(f"/sluice/pipelines/{spec.name}/epochs", "viewer", params={"last": 5, "before": 0}).json() == []
    for params in ({"last": 2**64}, {"before": -1}, {"last": "all"}):
        assert get(f"/sluice/pipelines/{spec.name}/epochs", "viewer", params=params).status_code == 422, params
    assert get(f"/sluice/pipelines/{spec.name}/groups", "viewer", params={"since": 2**63}).status_code == 422
    control = get(f"/sluice/pipelines/{spec.name}/control", "viewer").json()
    assert control["backlog"]["files"] == 1 and control["next"]["epoch_size"] == spec.control.epoch_files, control
    assert get("/sluice/pipelines/no_such_pipeline/epochs", "viewer").status_code == 404
    # Its one group, planned outside Airflow (no DAG run); a rollback to epoch 0 would be refused:
    # epoch 0 is not written yet.
    groups = get(f"/sluice/pipelines/{spec.name}/groups", "viewer").json()
    assert [(g["group_id"], g["epoch_ids"], g["dag_run"]) for g in groups] == [(0, [0], None)], groups
    preview = get(f"/sluice/pipelines/{spec.name}/rollback-preview", "viewer", params={"to_epoch": 0}).json()
    assert preview["rolled_back"][0]["epoch_id"] == 0 and preview["kept"] == 0, preview
    page = get(f"/sluice/ui/{spec.name}", "viewer")
    assert page.status_code == 200 and f'const PIPELINE = "{spec.name}";' in page.text
    names = {p["pipeline"] for p in get("/sluice/pipelines", "admin").json()}
    assert {"ysb", "auth_probe"} <= names
    # The Airflow UI keeps the user's token in its session cookie; a page of the plugin sends it.
    with httpx.Client(base_url=server.url, timeout=30.0, cookies={"_token": tokens["viewer"]}) as browser:
        assert browser.get(f"/sluice/pipelines/{spec.name}/epochs").status_code == 200


def test_no_request_built_from_the_openapi_schema_gets_a_500(api):
    """Every GET route of the plugin's OpenAPI schema, with arbitrary path parameters (any
    text: slashes, dots, percent signs, control characters, very long; or a pipeline's name) and
    query parameters (any integer, past 64 bits too, or text), with and without a token: an
    answer, never a server error."""
    from sluice.api.app import app

    server, tokens = api
    paths = app.openapi()["paths"]
    routes = [path for path, item in paths.items() if "get" in item]
    assert len(routes) >= 3, routes
    queries = {path: [p["name"] for p in paths[path]["get"].get("parameters", []) if p["in"] == "query"]
               for path in routes}
    assert {"last", "before"} <= set(queries["/pipelines/{dag_id}/epochs"]), queries
    values = st.one_of(st.integers(), st.integers(min_value=2**62), st.text(max_size=20))

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(route=st.sampled_from(routes), value=st.one_of(st.text(max_size=300), st.just("ysb")),
           user=st.sampled_from([None, "viewer", "nobody"]), data=st.data())
    def answers(route: str, value: str, user: str | None, data: st.DataObject) -> None:
        path = "/sluice" + route.replace("{dag_id}", quote(value, safe=""))
        params = {name: data.draw(values) for name in queries[route] if data.draw(st.booleans())}
        headers = {"Authorization": f"Bearer {tokens[user]}"} if user else {}
        with httpx.Client(base_url=server.url, timeout=30.0) as client:
            response = client.get(path, headers=headers, params=params)
        assert response.status_code < 500, (path, user, response.status_code, response.text[:500])
        if user is None and "{dag_id}" in route and value.isidentifier():  # a name a pipeline could have
            assert response.status_code == 401, (path, response.status_code)

    answers()
