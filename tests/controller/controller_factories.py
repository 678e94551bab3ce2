"""Factories for controller tests: say what a test needs, default the rest."""

from __future__ import annotations

from stallfree.operator.controller import (
    ClusterSnapshot,
    ClusterSpec,
    ControllerConfig,
    Knobs,
    Settings,
    Slo,
    Snapshot,
)

CHAT_SLO = Slo(ttft_p99=1.0, tbt_p99=0.1, scheduling_delay_p50=0.5)
SUMM_SLO = Slo(ttft_p99=10.0, tbt_p99=0.25, scheduling_delay_p50=5.0)


def make_specs(**kw) -> tuple[ClusterSpec, ...]:
    """chat (priority 10) and summarization (priority 0), like examples/local.yaml."""
    return (
        ClusterSpec(
            "chat", slo=kw.get("chat_slo", CHAT_SLO), priority=10, knobs=Knobs(chunk_cap=None, max_waiting=64)
        ),
        ClusterSpec(
            "summarization",
            slo=kw.get("summ_slo", SUMM_SLO),
            priority=0,
            knobs=Knobs(chunk_cap=kw.get("summ_cap", 256), max_waiting=32),
        ),
    )


def make_config(**kw) -> ControllerConfig:
    base = dict(budget_min=128, budget_max=2048, align=32, replicas_min=1, replicas_max=1)
    base.update(kw)
    return ControllerConfig(**base)


def make_settings(budget: int = 512, replicas: int = 1, **clusters: Knobs) -> Settings:
    return Settings(token_budget=budget, replicas=replicas, clusters=dict(clusters))


def make_snapshot(t: float = 0.0, **clusters: dict) -> Snapshot:
    """make_snapshot(chat=dict(tbt_p99=0.2, running=4), summarization=dict(...))."""
    return Snapshot(time=t, clusters={n: ClusterSnapshot(name=n, **v) for n, v in clusters.items()})


def make_profile(**coefficients: float):
    """A cost model as `stallfree profile` fits it (trusted in absolute terms), with the shape of a 2-core
    CPU's: about 2.6 ms per prefill token, 4.4 ms per decode; any coefficient can be overridden."""
    from stallfree.costmodel.fitted import FittedCostModel
    from stallfree.costmodel.model import ProfiledCostModel

    base = dict(const=0.06, prefill_tokens=2.6e-3, decode_tokens=4.4e-3, prefill_attn=1.7e-6,
                decode_attn=2e-5, prefill_chunks=0.015)  # fmt: skip
    base.update(coefficients)
    return ProfiledCostModel(FittedCostModel(base))
