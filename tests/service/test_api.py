"""API v1 over HTTP against a real daemon process: every route, every refusal."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("uvicorn", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("httpx", reason="needs the service extra: pip install 'kvtier[service]'")

import os
import re
from pathlib import Path

import httpx
import pytest

from kvtier.service import wire
from kvtier.service.routes.table import ROUTES

from .conftest import Daemon

MiB = 1 << 20


def key() -> str:
    return os.urandom(16).hex()


@pytest.fixture(scope="module")
def http(daemon: Daemon):
    with httpx.Client(base_url=daemon.url, timeout=30) as c:
        yield c


def test_put_get_head_delete_round_trip(http: httpx.Client) -> None:
    k, v = key(), os.urandom(300_001)
    assert http.head(f"/v1/chunks/{k}").status_code == 404
    r = http.put(f"/v1/chunks/{k}", content=v)
    assert r.status_code == 200
    assert r.json() == {"stored": 1, "present": 0, "rejected": 0, "failed": 0}
    assert http.head(f"/v1/chunks/{k}").status_code == 200
    got = http.get(f"/v1/chunks/{k}")
    assert got.status_code == 200
    assert got.headers["content-type"] == "application/octet-stream"
    assert got.content == v
    # Keys are write-once: a second put leaves the first value.
    assert http.put(f"/v1/chunks/{k}", content=b"other").json()["present"] == 1
    assert http.get(f"/v1/chunks/{k}").content == v
    assert http.delete(f"/v1/chunks/{k}").json() == {"deleted": 1}
    assert http.delete(f"/v1/chunks/{k}").json() == {"deleted": 0}
    miss = http.get(f"/v1/chunks/{k}")
    assert miss.status_code == 404
    assert miss.json()["code"] == "not_found"


def test_upper_case_keys_name_the_same_chunk(http: httpx.Client) -> None:
    k, v = key(), b"x" * 10
    http.put(f"/v1/chunks/{k.upper()}", content=v)
    assert http.get(f"/v1/chunks/{k}").content == v


def test_lookup_reports_the_leading_run(http: httpx.Client) -> None:
    ks = [key() for _ in range(4)]
    for k in ks[:2]:
        http.put(f"/v1/chunks/{k}", content=b"v" * 4096)
    http.put(f"/v1/chunks/{ks[3]}", content=b"v" * 4096)
    r = http.post("/v1/lookup", json={"keys": ks})
    assert r.json() == {"hits": 2, "tiers": ["host", "host"]}


def test_batch_put_then_batch_get_returns_the_same_bytes(http: httpx.Client) -> None:
    ks = [key() for _ in range(6)]
    # Mixed lengths: the server splits them into runs of equal length.
    vals = [os.urandom(n) for n in (4096, 4096, 1000, 1000, MiB, 17)]
    body = wire.pack([bytes.fromhex(k) for k in ks], vals)
    r = http.post("/v1/batch/put", content=bytes(body), headers={"content-type": wire.MEDIA_TYPE})
    assert r.status_code == 200, r.text
    assert r.json() == {"stored": 6, "present": 0, "rejected": 0, "failed": 0}
    miss = key()
    r = http.post("/v1/batch/get", json={"keys": [*ks[:4], miss, ks[4]]})
    assert r.status_code == 200
    batch = wire.parse(r.content, max_count=6, max_value_bytes=MiB)
    assert [k.hex() for k in batch.keys] == ks[:4]
    assert [bytes(batch.value(i)) for i in range(4)] == vals[:4]
    assert not batch.truncated
    # Answered by the fast path, counted under the route's own label.
    text = http.get("/metrics").text
    assert 'kvtier_http_requests_total{route="/v1/batch/get",method="POST",status="200"}' in text


def test_batch_get_of_nothing_present_is_an_empty_batch(http: httpx.Client) -> None:
    r = http.post("/v1/batch/get", json={"keys": [key(), key()]})
    batch = wire.parse(r.content, max_count=2, max_value_bytes=MiB)
    assert batch.keys == ()


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "code"),
    [
        ("GET", "/v1/chunks/abc", {}, 422, "invalid_request"),
        ("GET", "/v1/chunks/" + "g" * 32, {}, 422, "invalid_request"),
        ("PUT", "/v1/chunks/" + "0" * 32, {"content": b""}, 400, "empty_value"),
        ("PUT", "/v1/chunks/" + "0" * 32, {"content": b"x" * (MiB + 1)}, 413, "body_too_large"),
        ("POST", "/v1/lookup", {"json": {"keys": ["xyz"]}}, 422, "invalid_request"),
        ("POST", "/v1/lookup", {"json": {"keys": ["0" * 32] * 1025}}, 413, "batch_too_large"),
        ("POST", "/v1/lookup", {"json": {"nokeys": []}}, 422, "invalid_request"),
        (
            "POST",
            "/v1/lookup",
            {"content": b"{not json", "headers": {"content-type": "application/json"}},
            422,
            "invalid_request",
        ),
        # Batch get: the fast path answers plain key lists; every other body reaches the
        # route, which answers it as before the fast path took that route.
        ("POST", "/v1/batch/get", {"json": {"keys": ["xyz"]}}, 422, "invalid_request"),
        ("POST", "/v1/batch/get", {"json": {"keys": ["0" * 32 + "\n"]}}, 422, "invalid_request"),
        ("POST", "/v1/batch/get", {"json": {"keys": ["0" * 32] * 1025}}, 413, "batch_too_large"),
        ("POST", "/v1/batch/get", {"json": {"keys": [], "more": 1}}, 422, "invalid_request"),
        ("POST", "/v1/batch/get", {"json": {"keys": "0" * 32}}, 422, "invalid_request"),
        ("POST", "/v1/batch/get", {"json": [["0" * 32]]}, 422, "invalid_request"),
        (
            "POST",
            "/v1/batch/get",
            {"content": b"{not json", "headers": {"content-type": "application/json"}},
            422,
            "invalid_request",
        ),
        ("POST", "/v1/batch/put", {"content": b"short"}, 400, "bad_batch"),
        ("POST", "/v1/batch/put", {"content": b"XXXX" + bytes(12)}, 400, "bad_batch"),
        ("GET", "/v1/nothing-here", {}, 404, "not_found"),
        ("PATCH", "/v1/chunks/" + "0" * 32, {}, 405, "method_not_allowed"),
    ],
)
def test_bad_requests_get_a_4xx_that_names_the_problem(
    http: httpx.Client, method: str, path: str, kwargs: dict, status: int, code: str
) -> None:
    r = http.request(method, path, **kwargs)
    assert r.status_code == status, r.text
    assert r.json()["code"] == code
    assert r.json()["message"]


def test_batch_put_refuses_a_table_pointing_past_the_body(http: httpx.Client) -> None:
    body = bytearray(wire.pack([os.urandom(16)], [b"abcd"]))
    body[16 + 24 : 16 + 32] = (1 << 40).to_bytes(8, "little")  # length far past the payload
    r = http.post("/v1/batch/put", content=bytes(body))
    assert r.status_code == 400
    assert "entry 0" in r.json()["message"]


def test_batch_put_refuses_duplicate_keys(http: httpx.Client) -> None:
    k = os.urandom(16)
    r = http.post("/v1/batch/put", content=bytes(wire.pack([k, k], [b"a", b"b"])))
    assert r.status_code == 400
    assert r.json()["code"] == "duplicate_key"


def test_batch_put_refuses_a_value_over_the_limit(http: httpx.Client) -> None:
    r = http.post("/v1/batch/put", content=bytes(wire.pack([os.urandom(16)], [bytes(MiB + 1)])))
    assert r.status_code == 400
    assert "1048576" in r.json()["message"]


def test_health_readiness_stats_and_metrics(http: httpx.Client) -> None:
    assert http.get("/healthz").json() == {"status": "ok"}
    assert http.get("/readyz").json() == {"status": "ready"}
    stats = http.get("/v1/stats").json()
    assert stats["limits"]["max_value_bytes"] == MiB
    assert stats["tenant"]["name"] == "anonymous"
    assert stats["store"]["tiers"][0]["kind"] == "host"
    metrics = http.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert 'kvtier_http_requests_total{route="/v1/chunks/{key}",method="GET",status="200"}' in text
    assert "kvtier_store_chunks " in text
    assert 'kvtier_tier_capacity_bytes{tier="host",kind="host"}' in text
    # Raw paths never become labels: a fuzzer cannot blow up the series count.
    assert "nothing-here" not in text


def test_openapi_documents_the_binary_formats(http: httpx.Client) -> None:
    doc = http.get("/openapi.json").json()
    put = doc["paths"]["/v1/batch/put"]["post"]
    assert "application/octet-stream" in put["requestBody"]["content"]
    assert "KVTB" in doc["info"]["description"]
    assert doc["components"]["x-kvtier-batch-format"]["entry_bytes"] == 32


def _eight_slots_over_nvme(data_dir: Path) -> tuple[str, ...]:
    """Daemon arguments: a host tier of 8 slots over the nvme tier --data-dir adds."""
    return (
        "--data-dir",
        str(data_dir),
        "--set",
        "tiers.0.capacity_bytes=8MiB",
        "--set",
        "service.data_capacity_bytes=64MiB",
    )


def test_data_dir_keeps_the_cache_across_a_restart(daemon_factory, tmp_path) -> None:
    # A host tier of 8 slots: most of the 20 values are demoted to the nvme tier that
    # --data-dir adds, and only those survive the restart (the key salt does too).
    args = (
        *_eight_slots_over_nvme(tmp_path),
        # Persistence is under test, not admission: the cost model would drop these
        # one-off values rather than write them to the SSD.
        "--set",
        "store.placement=keep",
    )
    first = daemon_factory(*args)
    keys = [key() for _ in range(20)]
    vals = {k: os.urandom(65536) for k in keys}
    with httpx.Client(base_url=first.url) as h:
        for k in keys:
            assert h.put(f"/v1/chunks/{k}", content=vals[k]).json()["stored"] == 1
        tiers = h.get("/v1/stats").json()["store"]["tiers"]
        assert [t["kind"] for t in tiers] == ["host", "nvme"]
    first.stop()
    assert (tmp_path / "key_salt").stat().st_mode & 0o777 == 0o600
    second = daemon_factory(*args)
    with httpx.Client(base_url=second.url) as h:
        survived = [k for k in keys if h.head(f"/v1/chunks/{k}").status_code == 200]
        assert len(survived) >= 12
        for k in survived:
            assert h.get(f"/v1/chunks/{k}").content == vals[k]


def test_stats_and_metrics_say_what_placement_decided(daemon_factory, tmp_path) -> None:
    # The default (cost) placement over a host tier of 8 slots and an nvme tier: 20
    # one-off values overflow the host tier, and the daemon reports, per tier and by
    # reason, where its victims went, in /v1/stats and /metrics alike.
    d = daemon_factory(*_eight_slots_over_nvme(tmp_path))
    with httpx.Client(base_url=d.url) as h:
        for _ in range(20):
            assert h.put(f"/v1/chunks/{key()}", content=os.urandom(65536)).json()["stored"] == 1
        placement = h.get("/v1/stats").json()["store"]["placement"]
        text = h.get("/metrics").text
    got = {(c["name"], c["tier"]): c["value"] for c in placement}
    assert got["admitted_chunks", "host"] == 20
    # Every victim is accounted for: demoted to the nvme tier, or dropped for a reason.
    victims = got["demoted_chunks", "nvme"] + got["dropped_chunks", ""]
    assert victims >= 12
    assert got["dropped_chunks", ""] == (
        got["refused_value_chunks", "nvme"]
        + got["refused_colder_chunks", "nvme"]
        + got["refused_budget_chunks", "nvme"]
    )
    assert got["budget_allowance_bytes", "nvme"] > 0
    # The write budget is charged the bytes written (64 KiB values), not the chunk size
    # of the model the daemon's economics assume.
    assert got["budget_granted_bytes", "nvme"] == got["demoted_chunks", "nvme"] * 65536 > 0
    for (name, tier), value in got.items():
        metric = f"kvtier_placement_{name}"
        series = [ln for ln in text.splitlines() if ln.startswith(metric)]
        label = f'{{tier="{tier}"}}' if tier else ""
        assert any(
            ln.split(" ")[0] in (f"{metric}{label}", f"{metric}_total{label}")
            and float(ln.split(" ")[1]) == value
            for ln in series
        ), (name, tier, series)
    # One HELP and one TYPE per metric, its series together (the format requires it).
    lines = [ln for ln in text.splitlines() if "kvtier_placement_" in ln]
    helps = [ln.split(" ")[2] for ln in lines if ln.startswith("# HELP")]
    assert len(helps) == len(set(helps))
    names = [ln.split("{")[0].split(" ")[0] for ln in lines if not ln.startswith("#")]
    assert names == sorted(names, key=names.index)  # contiguous runs


def _documented_series() -> set[str]:
    """The placement metrics docs/operations.md lists, brace groups expanded."""
    text = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    names: set[str] = set()
    for cell in re.findall(r"`(kvtier_placement_[a-z_{},]+)", text):
        todo = [cell.split("{tier")[0]]
        while todo:
            s = todo.pop()
            m = re.search(r"\{([a-z_,]+)\}", s)
            if m is None:
                names.add(s)
                continue
            todo += [s[: m.start()] + alt + s[m.end() :] for alt in m.group(1).split(",")]
    return names


def test_every_placement_series_is_documented(daemon_factory, tmp_path) -> None:
    d = daemon_factory("--data-dir", str(tmp_path), "--set", "service.data_capacity_bytes=64MiB")
    with httpx.Client(base_url=d.url) as h:
        text = h.get("/metrics").text
    lines = text.splitlines()
    emitted = {ln.split(" ")[2] for ln in lines if ln.startswith("# HELP kvtier_placement")}
    assert len(emitted) == 11
    documented = _documented_series()
    assert emitted - documented == set(), documented


def test_the_daemon_serves_exactly_the_routes_of_its_table(http: httpx.Client) -> None:
    doc = http.get("/openapi.json").json()
    served = {(m.upper(), path) for path, ops in doc["paths"].items() for m in ops}
    assert served == {(r.method, r.template) for r in ROUTES}
    for r in ROUTES:
        assert doc["paths"][r.template][r.method.lower()]["summary"] == r.summary
