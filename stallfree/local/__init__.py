"""`stallfree up FILE`: run a SarathiDeployment on this machine (local mode).

Engine replicas run as local `stallfree serve` processes behind one OpenAI endpoint; the budget controller
reads their stats (or a Prometheus given with --prometheus), retunes them through their admin API, and shows
what it does live. Ctrl-C / SIGTERM stops everything, children included.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import secrets
import socket
import sys

log = logging.getLogger("stallfree.local")

EPILOG = """\
examples:
  stallfree up examples/local.yaml                        # OpenAI endpoint on http://127.0.0.1:8000/v1
  stallfree up examples/local.yaml --port 9000 --prometheus http://127.0.0.1:9090
  curl -s localhost:8000/admin/v1/status                  # the status document (the CR's .status)
  curl -s localhost:8000/v1/chat/completions -H 'x-traffic-cluster: chat' \\
       -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}]}'
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stallfree up",
        description="Run a SarathiDeployment on this machine: engine replicas behind one OpenAI endpoint, "
        "with the SLO budget controller retuning them live.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("file", help="a SarathiDeployment YAML file (validated against the CRD schema)")
    p.add_argument("--host", default="127.0.0.1", help="bind address of the endpoint (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port of the OpenAI endpoint (default %(default)s)")
    p.add_argument(
        "--prometheus", metavar="URL", default=None,
        help="read engine metrics from this Prometheus instead of the engines' /admin/v1/stats "
        "(it must scrape the engines: see the targets file printed at start)",
    )  # fmt: skip
    p.add_argument(
        "--admin-token", default=None,
        help="bearer token for /admin/v1/*; without one the admin API is open on loopback, and a random "
        "token is made (and printed) when --host is not a loopback address",
    )  # fmt: skip
    p.add_argument(
        "--cost-model",
        metavar="JSON",
        default=None,
        help="a `stallfree profile` cost model file (takes the place of the spec's controller.costModel)",
    )
    p.add_argument(
        "--no-controller", action="store_true", help="serve with the spec's settings, never retune"
    )
    p.add_argument("--no-view", action="store_true", help="log lines instead of the live view")
    p.add_argument(
        "--ready-timeout", type=float, default=600.0, help="seconds to wait for engines (default %(default)s)"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log more")
    return p


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("httpx", "httpcore", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from stallfree.local.config import LocalConfigError, load

    try:
        dep = load(args.file)
    except LocalConfigError as e:
        print(f"stallfree up: {args.file}: {e}", file=sys.stderr)
        return 2
    if not _port_free(args.host, args.port):
        print(f"stallfree up: {args.host}:{args.port} is in use; pick another with --port", file=sys.stderr)
        return 2
    admin_token = args.admin_token
    if admin_token is None and not _loopback(args.host):
        admin_token = secrets.token_urlsafe(24)
        print(f"admin token (binding {args.host}): {admin_token}", file=sys.stderr)
    from stallfree.local.run import LocalRun

    run = LocalRun(dep, args, admin_token)
    return run.serve()


__all__ = ["build_parser", "main"]
