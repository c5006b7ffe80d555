"""Schemathesis against the live OpenAPI document of a real daemon.

At least 1,000 generated requests, valid and invalid, with and without a token: no
5xx, every answer conforms to the documented status codes and schemas, and the daemon
still serves correctly afterwards.
"""

from __future__ import annotations

import pytest

pytest.importorskip("schemathesis", reason="needs the dev extra: schemathesis")
pytest.importorskip("fastapi", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("uvicorn", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("httpx", reason="needs the service extra: pip install 'kvtier[service]'")

import os
from typing import Any

import httpx
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from .conftest import TOKENS, Daemon

pytestmark = pytest.mark.slow

MIN_CASES = 1000
PER_OPERATION_AND_MODE = 70
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


class Tally:
    """What the fuzzer saw: status counts and check failures (collected, not raised, so
    one failure does not hide the others)."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}
        self.failures: list[str] = []
        self.not_http = 0

    @property
    def total(self) -> int:
        return sum(self.seen.values()) + len(self.failures) + self.not_http


# uvicorn's own answer to bytes that are not a valid HTTP request (a generated header
# such as ``Content-Length: u4[v``): the request never reaches the application, so the
# OpenAPI document, which describes the application, does not cover it.
_UVICORN_BAD_REQUEST = b"Invalid HTTP request received."


def _not_http(resp: Any) -> bool:
    # Schemathesis gives headers as lower-case names -> lists of values.
    return (
        resp.status_code == 400
        and resp.headers.get("content-type", [""])[0].startswith("text/plain")
        and resp.content == _UVICORN_BAD_REQUEST
    )


def fuzz(
    op: Any, mode: GenerationMode, session: requests.Session, auth: dict, tally: Tally
) -> None:
    @settings(
        max_examples=PER_OPERATION_AND_MODE,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        # One request in four goes without the token: the 401 path is fuzzed too.
        headers = auth if tally.total % 4 != 3 else None
        try:
            resp = case.call(session=session, headers=headers)
            if _not_http(resp):
                tally.not_http += 1
                return
            case.validate_response(resp, checks=CHECKS)
        except Exception as exc:
            tally.failures.append(f"{op.label} [{mode.value}]: {exc}"[:2000])
            return
        tally.seen[resp.status_code] = tally.seen.get(resp.status_code, 0) + 1

    try:
        run()
    except Unsatisfiable:
        # No invalid input exists for an operation without parameters (/healthz).
        assert mode is GenerationMode.NEGATIVE, op.label


def test_fuzz_live_openapi_has_no_server_errors(tenant_daemon: Daemon) -> None:
    schema = schemathesis.openapi.from_url(f"{tenant_daemon.url}/openapi.json")
    session = requests.Session()
    auth = {"Authorization": f"Bearer {TOKENS['alice']}"}
    tally = Tally()
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) >= 11
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz(op, mode, session, auth, tally)
    seen, failures, total = tally.seen, tally.failures, tally.total
    assert not failures, "\n\n".join(failures[:5])
    print(f"fuzz: {total} cases, statuses {sorted(seen.items())}, not HTTP {tally.not_http}")
    # The parser's rejections are rare accidents of generation, not what is fuzzed.
    assert tally.not_http <= total // 20, tally.not_http
    assert total >= MIN_CASES, seen
    assert not any(code >= 500 for code in seen), seen
    # Still alive and still correct.
    with httpx.Client(base_url=tenant_daemon.url, headers=auth) as c:
        assert c.get("/readyz").status_code == 200
        k, v = os.urandom(16).hex(), os.urandom(1000)
        assert c.put(f"/v1/chunks/{k}", content=v).status_code == 200
        assert c.get(f"/v1/chunks/{k}").content == v
