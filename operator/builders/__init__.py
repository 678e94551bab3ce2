"""Pure builder functions: a validated SarathiDeployment spec in, Kubernetes manifests (dicts) out.

No I/O here; stallfree.operator.reconcile applies what these return. Golden files in tests/operator/golden/
pin the output.
"""

from __future__ import annotations

from stallfree.operator.builders.config import (
    build_admin_secret,
    build_config_map,
    engine_config,
    render_engine_config,
)
from stallfree.operator.builders.meta import BuildContext, Features, Owner, Tuned, selector_string
from stallfree.operator.builders.model import build_cache_claim
from stallfree.operator.builders.network import (
    build_headless_service,
    build_pdb,
    build_service,
    build_service_monitor,
)
from stallfree.operator.builders.workload import build_workloads, engine_args

__all__ = [
    "BuildContext",
    "Features",
    "Owner",
    "Tuned",
    "build_admin_secret",
    "build_children",
    "build_config_map",
    "engine_args",
    "engine_config",
    "render_engine_config",
    "selector_string",
]


def build_children(ctx: BuildContext) -> list[dict]:
    """Every child the operator applies (server-side apply), in apply order. The admin Secret is not here:
    it is created once, when missing (see build_admin_secret)."""
    children = [build_config_map(ctx), build_service(ctx)]
    claim = build_cache_claim(ctx)
    if claim is not None:
        children.append(claim)  # before the workload that mounts it
    if ctx.spec.multi_node and not ctx.features.leader_worker_set:
        children.append(build_headless_service(ctx))
    children += build_workloads(ctx)
    children.append(build_pdb(ctx))
    if ctx.features.service_monitor:
        children.append(build_service_monitor(ctx))
    return children
