"""A real daemon through a full disk (issue 11): a real small filesystem (a tmpfs mounted
for the test, as root; skipped with the reason otherwise), deletes and re-puts while it
is full and after, restarts in between: 0 stale or wrong bytes.

The test keeps, for every key, the values a GET may return: an acknowledged PUT makes
its value the only one (or a miss: a cache may always miss); an acknowledged DELETE
allows only a miss; a DELETE answered ``503 not_durable`` (not acknowledged) allows the
old value or a miss. Anything else a GET returns is stale or wrong.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("uvicorn", reason="needs the service extra: pip install 'kvtier[service]'")
pytest.importorskip("httpx", reason="needs the service extra: pip install 'kvtier[service]'")

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.tmpfs import fill, mounted_tmpfs

from .conftest import DaemonFactory

KiB = 1024
VALUE = 64 * KiB


@pytest.fixture(scope="module")
def small_fs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with mounted_tmpfs(
        tmp_path_factory.mktemp("fs"),
        "12m",
        "needs root to mount a small tmpfs (a real full disk); not root here",
    ) as mnt:
        yield mnt


class Truth:
    """What each key may answer: a set of acceptable values (None: a miss)."""

    def __init__(self) -> None:
        self.allowed: dict[str, set[bytes | None]] = {}
        self.acked_deletes = 0
        self.refused_deletes = 0

    def put(self, h: httpx.Client, k: str, v: bytes) -> None:
        r = h.put(f"/v1/chunks/{k}", content=v)
        if r.status_code == 200 and r.json()["stored"] == 1:
            self.allowed[k] = {v, None}
        # present (write-once), rejected, failed or 503: what was allowed still is.
        self.allowed.setdefault(k, {None})

    def delete(self, h: httpx.Client, k: str) -> None:
        r = h.delete(f"/v1/chunks/{k}")
        if r.status_code == 200:
            self.allowed[k] = {None}
            self.acked_deletes += 1
        else:
            assert r.status_code == 503, r.text  # not durable: not acknowledged
            assert r.json()["code"] == "not_durable"
            assert r.headers["retry-after"]
            self.allowed.setdefault(k, set()).add(None)
            self.refused_deletes += 1

    def check(self, h: httpx.Client) -> tuple[int, int]:
        """(keys served, keys served with stale or wrong bytes)."""
        served = bad = 0
        for k, ok in self.allowed.items():
            r = h.get(f"/v1/chunks/{k}")
            assert r.status_code in (200, 404), r.text
            got = r.content if r.status_code == 200 else None
            served += got is not None
            bad += got not in ok
        return served, bad


def test_full_disk_with_deletes_and_re_puts_across_restarts_serves_no_stale_bytes(
    daemon_factory: DaemonFactory, small_fs: Path
) -> None:
    args = (
        "--data-dir",
        str(small_fs / "data"),
        "--set",
        f"service.max_value_bytes={VALUE}",
        "--set",
        f"tiers.0.capacity_bytes={4 * VALUE}",  # 4 slots: the rest goes to the nvme tier
        "--set",
        "service.data_capacity_bytes=6MiB",
        "--set",
        "store.placement=keep",
    )
    truth = Truth()
    keys = [os.urandom(16).hex() for _ in range(120)]
    d = daemon_factory(*args)
    with httpx.Client(base_url=d.url, timeout=60) as h:
        for k in keys[:90]:
            truth.put(h, k, os.urandom(VALUE))
        filler = fill(small_fs)
        # While full: delete old keys (80 records: more than the journal's last page
        # holds), store some again, store new ones.
        for k in keys[:80]:
            truth.delete(h, k)
        for k in keys[:20] + keys[90:100]:
            truth.put(h, k, os.urandom(VALUE))
        filler.unlink()
        # Space is back: deletes that were refused go through; re-puts land elsewhere.
        for k in keys[:80]:
            truth.delete(h, k)
        for k in keys[:40]:
            truth.put(h, k, os.urandom(VALUE))
        assert truth.check(h)[1] == 0
    d.stop()
    assert truth.refused_deletes > 0, "the disk never refused a deletion: nothing was tested"

    d = daemon_factory(*args)
    with httpx.Client(base_url=d.url, timeout=60) as h:
        served, bad = truth.check(h)
        assert bad == 0
        assert served > 0
        # A second round, full again, then a restart while still full.
        filler = fill(small_fs)
        for k in keys[40:70]:
            truth.delete(h, k)
        for k in keys[40:50] + keys[100:]:
            truth.put(h, k, os.urandom(VALUE))
        assert truth.check(h)[1] == 0
    d.stop()
    d = daemon_factory(*args)
    with httpx.Client(base_url=d.url, timeout=60) as h:
        assert truth.check(h)[1] == 0
    d.stop()
    filler.unlink()
    d = daemon_factory(*args)
    with httpx.Client(base_url=d.url, timeout=60) as h:
        assert truth.check(h)[1] == 0
