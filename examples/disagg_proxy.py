"""A minimal prefill/decode proxy for two vLLM engines that share a kvtier daemon.

    python examples/disagg_proxy.py --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

The prefill engine runs the kvtier connector with ``"kv_role": "kv_producer"``, the decode
engine with ``"kv_consumer"``, both with the same daemon ``url`` (docs/connector.md,
"Prefill/decode disaggregation"). For each ``POST /v1/completions`` or
``/v1/chat/completions`` the proxy:

1. sends the body to the prefill engine with ``max_tokens`` 1 and streaming off: it
   computes the prompt's KV, saves it into the daemon, and answers with
   ``kv_transfer_params`` that name the saved chunks;
2. sends the client's body, with those ``kv_transfer_params``, to the decode engine: it
   loads the prompt's KV from the daemon (waiting, bounded, for a save still in flight)
   and generates; its answer goes back to the client unchanged (streamed if asked).

When the prefill engine fails or cannot be reached, the decode engine computes the
prompt itself: slower, same output. Standard library only; not for production (one
thread per request, no retries, no load balancing).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("disagg_proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")


def post(url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        out: dict[str, Any] = json.load(r)
    return out


def prefill(base: str, route: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
    """Run the prompt on the prefill engine; its ``kv_transfer_params``, or None on failure."""
    pre = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    pre["max_tokens"] = 1
    if "max_completion_tokens" in pre:
        pre["max_completion_tokens"] = 1
    pre.pop("kv_transfer_params", None)
    t0 = time.perf_counter()
    try:
        out = post(base + route, pre, timeout_s)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        log.warning(
            "prefill engine %s failed (%s): the decode engine computes the prompt", base, exc
        )
        return None
    params = out.get("kv_transfer_params")
    log.info("prefill %.3f s, kv_transfer_params %s", time.perf_counter() - t0, params)
    return params if isinstance(params, dict) else None


class Proxy(BaseHTTPRequestHandler):
    server: ProxyServer

    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply(200, b"{}", "application/json")
        else:
            self._reply(404, b'{"error": "not found"}', "application/json")

    def do_POST(self) -> None:
        if self.path not in ROUTES:
            self._reply(404, b'{"error": "not found"}', "application/json")
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        except ValueError:
            self._reply(400, b'{"error": "a JSON body"}', "application/json")
            return
        cfg = self.server
        params = prefill(cfg.prefill_url, self.path, body, cfg.timeout_s)
        dec = dict(body)
        if params is not None:
            dec["kv_transfer_params"] = params
        req = urllib.request.Request(
            cfg.decode_url + self.path,
            json.dumps(dec).encode(),
            {"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=cfg.timeout_s) as r:
                self.send_response(r.status)
                self.send_header("Content-Type", r.headers.get("Content-Type", "application/json"))
                self.send_header("Connection", "close")
                self.end_headers()
                while chunk := r.read1(65536):  # streams pass through as they come
                    self.wfile.write(chunk)
                    self.wfile.flush()
        except urllib.error.HTTPError as exc:
            self._reply(exc.code, exc.read(), "application/json")
        except (urllib.error.URLError, OSError) as exc:
            msg = json.dumps({"error": f"decode engine {cfg.decode_url}: {exc}"}).encode()
            self._reply(502, msg, "application/json")

    def _reply(self, status: int, data: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug(format, *args)


class ProxyServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], prefill_url: str, decode_url: str, timeout_s: float):
        super().__init__(addr, Proxy)
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        self.timeout_s = timeout_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prefill", required=True, help="base URL of the kv_producer engine")
    p.add_argument("--decode", required=True, help="base URL of the kv_consumer engine")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout-s", type=float, default=600.0, help="per engine request")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s disagg_proxy %(message)s")
    server = ProxyServer((a.host, a.port), a.prefill, a.decode, a.timeout_s)
    log.info(
        "listening on http://%s:%d: prefill %s, decode %s", a.host, a.port, a.prefill, a.decode
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
