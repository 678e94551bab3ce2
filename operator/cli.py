"""`stallfree operator`: run the SarathiDeployment operator (kopf)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from stallfree.operator.reconcile import DEFAULT_ENGINE_IMAGE, OperatorConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stallfree operator",
        description="Run the SarathiDeployment operator: engine fleets from serving.stallfree.dev/v1alpha1 objects.",
    )
    scope = p.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "-n", "--namespace", action="append", dest="namespaces", metavar="NS",
        help="watch this namespace (repeatable; glob patterns allowed)",
    )  # fmt: skip
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    p.add_argument(
        "--engine-image",
        default=os.environ.get("STALLFREE_ENGINE_IMAGE", DEFAULT_ENGINE_IMAGE),
        help="engine image for resources that set no spec.engine.image (env STALLFREE_ENGINE_IMAGE; default %(default)s)",
    )
    p.add_argument(
        "--prometheus-url",
        default=os.environ.get("STALLFREE_PROMETHEUS_URL") or None,
        help="Prometheus the budget controller reads when a resource sets no spec.controller.prometheusUrl",
    )
    p.add_argument(
        "--hf-endpoint",
        default=os.environ.get("HF_ENDPOINT") or None,
        help="Hugging Face Hub URL for HuggingFace model sources that set no spec.model.source.endpoint "
        "(env HF_ENDPOINT; default: the public hub)",
    )
    p.add_argument(
        "--resync-seconds", type=float, default=30.0,
        help="period of the drift-correcting timer per resource (default %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="liveness endpoint URL served by the operator; empty to disable (default %(default)s)",
    )
    verbosity = p.add_mutually_exclusive_group()
    verbosity.add_argument("-v", "--verbose", action="store_true", help="log more")
    verbosity.add_argument("-q", "--quiet", action="store_true", help="log warnings and errors only")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.resync_seconds <= 0:
        build_parser().error("--resync-seconds must be positive")
    config = OperatorConfig(
        engine_image=args.engine_image,
        prometheus_url=args.prometheus_url,
        resync_seconds=args.resync_seconds,
        hub_endpoint=args.hf_endpoint,
    )
    # kopf is imported here so that `stallfree operator --help` works without it.
    import kopf

    from stallfree.operator.handlers import make_registry

    kopf.configure(verbose=args.verbose, quiet=args.quiet)
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    try:
        asyncio.run(
            kopf.operator(
                registry=make_registry(config),
                clusterwide=args.all_namespaces,
                namespaces=args.namespaces or (),
                liveness_endpoint=args.liveness or None,
                standalone=True,
            )
        )
    except KeyboardInterrupt:
        return 130
    return 0
