"""Traffic clusters: the config file, request classification, and run-time patches (admin API).

File shape (YAML or JSON; the operator writes the same into its ConfigMap):

    tokenBudget: 2048      # the token mode's budget; with timeTarget, the cap of an iteration
    timeTarget: 0.8        # time-budgeted iterations (share of the P99 TBT SLO); null = the token mode
    minTokenBudget: 16     # with timeTarget: the floor of an iteration, whatever the prediction
    chunkAlign: 0
    trafficClusters:
      - name: chat
        match: {header: chat, minPromptTokens: 0, maxPromptTokens: 2048}
        slo: {ttftP99Seconds: 2.0, tbtP99Seconds: 0.2, schedulingDelayP50Seconds: 2.0}
        chunkCap: 512
        maxWaiting: 64
        maxRunning: 32
        priority: 0

A request matches a cluster when all of the cluster's `match` conditions hold. Clusters whose header equals
the request's `x-traffic-cluster` header are tried first, then clusters without a header condition, in file
order; unmatched requests go to `default` (implicit and unlimited unless the file defines it).
Everything here is immutable: a patch returns a new TrafficConfig.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from stallfree.engine.config import SchedulerTunables, TrafficClusterLimits
from stallfree.slo import WIRE_NAMES

DEFAULT_CLUSTER = "default"
DEFAULT_MIN_TOKEN_BUDGET = 16
_TOP_FIELDS = ("tokenBudget", "timeTarget", "minTokenBudget", "chunkAlign", "trafficClusters")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_SLO_FIELDS = WIRE_NAMES  # the CRD's camelCase names, defined once in stallfree.slo
_LIMIT_FIELDS = {"chunkCap": "chunk_cap", "maxWaiting": "max_waiting", "maxRunning": "max_running"}
_MATCH_FIELDS = {
    "header": "header",
    "minPromptTokens": "min_prompt_tokens",
    "maxPromptTokens": "max_prompt_tokens",
}


class TrafficConfigError(ValueError):
    """A bad traffic-cluster document; the message names the field (`trafficClusters[1].chunkCap`)."""


@dataclass(frozen=True, slots=True)
class SLO:
    """A cluster's objectives as the engine's file and admin API give them: stallfree.slo.Slo's fields and
    wire names, but each may be left out (None: the engine has no such objective for the cluster, where the
    CRD would default it). The operator always writes all three."""

    ttft_p99: float | None = None
    tbt_p99: float | None = None
    scheduling_delay_p50: float | None = None

    def to_json(self) -> dict[str, float]:
        return {k: getattr(self, a) for k, a in _SLO_FIELDS.items() if getattr(self, a) is not None}


@dataclass(frozen=True, slots=True)
class Match:
    header: str | None = None
    min_prompt_tokens: int = 0
    max_prompt_tokens: int | None = None

    def fits(self, prompt_tokens: int) -> bool:
        return prompt_tokens >= self.min_prompt_tokens and (
            self.max_prompt_tokens is None or prompt_tokens <= self.max_prompt_tokens
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"minPromptTokens": self.min_prompt_tokens}
        if self.header is not None:
            out["header"] = self.header
        if self.max_prompt_tokens is not None:
            out["maxPromptTokens"] = self.max_prompt_tokens
        return out


@dataclass(frozen=True, slots=True)
class TrafficCluster:
    name: str
    match: Match = field(default_factory=Match)
    slo: SLO = field(default_factory=SLO)
    chunk_cap: int | None = None
    max_waiting: int | None = None
    max_running: int | None = None
    priority: int = 0

    def limits(self) -> TrafficClusterLimits:
        return TrafficClusterLimits(
            self.name,
            self.chunk_cap,
            self.max_running,
            self.priority,
            tbt_slo=self.slo.tbt_p99,
            ttft_slo=self.slo.ttft_p99,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "chunkCap": self.chunk_cap,
            "maxWaiting": self.max_waiting,
            "maxRunning": self.max_running,
            "priority": self.priority,
            "slo": self.slo.to_json(),
            "match": self.match.to_json(),
        }


@dataclass(frozen=True, slots=True)
class TrafficConfig:
    """The run-time tunable settings: token budget (or time target, floor and cap), chunk alignment and the
    traffic clusters."""

    token_budget: int = 512
    chunk_align: int = 0
    clusters: tuple[TrafficCluster, ...] = ()
    time_target: float | None = None
    min_token_budget: int = 16

    def __post_init__(self) -> None:
        if not any(c.name == DEFAULT_CLUSTER for c in self.clusters):
            object.__setattr__(self, "clusters", (*self.clusters, TrafficCluster(DEFAULT_CLUSTER)))
        if self.time_target is not None and self.min_token_budget > self.token_budget:
            raise TrafficConfigError(
                f"minTokenBudget ({self.min_token_budget}) must be <= tokenBudget ({self.token_budget}), "
                "the cap of a time-budgeted iteration"
            )

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.clusters]

    def cluster(self, name: str) -> TrafficCluster:
        for c in self.clusters:
            if c.name == name:
                return c
        raise KeyError(name)

    def classify(self, header: str | None, prompt_tokens: int) -> str | None:
        """The cluster of a request, or None when `header` names no known cluster."""
        if header:
            named = [c for c in self.clusters if header in (c.match.header, c.name)]
            if not named:
                return None
            for c in named:
                if c.match.fits(prompt_tokens):
                    return c.name
        for c in self.clusters:
            if c.match.header is None and c.name != DEFAULT_CLUSTER and c.match.fits(prompt_tokens):
                return c.name
        return DEFAULT_CLUSTER

    def known_headers(self) -> list[str]:
        return sorted(
            {c.name for c in self.clusters} | {c.match.header for c in self.clusters if c.match.header}
        )

    def tunables(self) -> SchedulerTunables:
        return SchedulerTunables(
            self.token_budget,
            tuple(c.limits() for c in self.clusters),
            time_target=self.time_target,
            min_token_budget=min(self.min_token_budget, self.token_budget),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "tokenBudget": self.token_budget,
            "timeTarget": self.time_target,
            "minTokenBudget": self.min_token_budget,
            "chunkAlign": self.chunk_align,
            "trafficClusters": {c.name: c.to_json() for c in self.clusters},
        }

    def patched(self, patch: Any) -> TrafficConfig:
        """Merge a partial document shaped like `to_json()`. Raises KeyError for an unknown cluster name
        and TrafficConfigError for bad values."""
        if not isinstance(patch, dict):
            raise TrafficConfigError("the body must be a JSON object shaped like GET /admin/v1/config")
        _no_unknown(patch, set(_TOP_FIELDS), "")
        budget = self.token_budget
        if "tokenBudget" in patch:
            budget = _int(patch["tokenBudget"], "tokenBudget", minimum=1)
        target, floor = _time_fields(patch, self.time_target, self.min_token_budget)
        align = self.chunk_align
        if "chunkAlign" in patch:
            align = _int(patch["chunkAlign"], "chunkAlign", minimum=0)
        clusters = list(self.clusters)
        changes = patch.get("trafficClusters", {})
        if not isinstance(changes, dict):
            raise TrafficConfigError("trafficClusters must be an object keyed by cluster name")
        for name, change in changes.items():
            idx = next((i for i, c in enumerate(clusters) if c.name == name), None)
            if idx is None:
                raise KeyError(name)
            clusters[idx] = _patch_cluster(clusters[idx], change, f"trafficClusters.{name}")
        return TrafficConfig(budget, align, tuple(clusters), target, floor)


# ---- parsing ----------------------------------------------------------------------------------------
def load_traffic_config(
    path: str | Path,
    default_budget: int = 512,
    chunk_align: int = 0,
    default_time_target: float | None = None,
) -> TrafficConfig:
    """Read a YAML or JSON traffic-cluster file. Raises TrafficConfigError naming the bad field."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise TrafficConfigError(f"cannot read traffic clusters file {path}: {e.strerror}") from e
    try:
        doc = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise TrafficConfigError(f"{path} is not valid YAML/JSON: {e}") from e
    try:
        return parse_traffic_config(doc or {}, default_budget, chunk_align, default_time_target)
    except TrafficConfigError as e:
        raise TrafficConfigError(f"{path}: {e}") from e


def parse_traffic_config(
    doc: Any, default_budget: int = 512, chunk_align: int = 0, default_time_target: float | None = None
) -> TrafficConfig:
    if not isinstance(doc, dict):
        raise TrafficConfigError("the traffic clusters document must be a mapping with `trafficClusters`")
    _no_unknown(doc, set(_TOP_FIELDS), "")
    budget = _int(doc.get("tokenBudget", default_budget), "tokenBudget", minimum=1)
    target, floor = _time_fields(doc, default_time_target, DEFAULT_MIN_TOKEN_BUDGET)
    align = _int(doc.get("chunkAlign", chunk_align), "chunkAlign", minimum=0)
    items = doc.get("trafficClusters") or []
    if not isinstance(items, list):
        raise TrafficConfigError("trafficClusters must be a list of clusters")
    clusters = [parse_cluster(item, f"trafficClusters[{i}]") for i, item in enumerate(items)]
    seen: set[str] = set()
    for i, c in enumerate(clusters):
        if c.name in seen:
            raise TrafficConfigError(
                f"trafficClusters[{i}].name {c.name!r} is used twice; names must be unique"
            )
        seen.add(c.name)
    return TrafficConfig(budget, align, tuple(clusters), target, floor)


def _time_fields(doc: dict, target: float | None, floor: int) -> tuple[float | None, int]:
    """timeTarget (null: the token mode) and minTokenBudget from a document, else the given ones."""
    if "timeTarget" in doc:
        v = doc["timeTarget"]
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1):
            raise TrafficConfigError(
                f"timeTarget must be in (0, 1] (the share of the P99 TBT SLO an iteration may take) or null "
                f"(the token budget alone), got {v!r}"
            )
        target = None if v is None else float(v)
    if "minTokenBudget" in doc:
        floor = _int(doc["minTokenBudget"], "minTokenBudget", minimum=1)
    return target, floor


def parse_cluster(item: Any, where: str) -> TrafficCluster:
    if not isinstance(item, dict):
        raise TrafficConfigError(f"{where} must be a mapping with at least `name`")
    _no_unknown(item, {"name", "match", "slo", "priority", *_LIMIT_FIELDS}, where)
    name = item.get("name")
    if not isinstance(name, str) or not _DNS_LABEL.match(name):
        raise TrafficConfigError(
            f"{where}.name must be a DNS label (lowercase letters, digits, '-'; at most 63), got {name!r}"
        )
    return _patch_cluster(TrafficCluster(name), {k: v for k, v in item.items() if k != "name"}, where)


def parse_cluster_flag(spec: str) -> dict[str, Any]:
    """`name=chat,header=chat,chunkCap=256,maxWaiting=64,tbtP99Seconds=0.2` -> a cluster document."""
    doc: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise TrafficConfigError(f"--traffic-cluster: expected key=value, got {part!r}")
        parsed: Any = value if key in ("name", "header") else yaml.safe_load(value)
        if key in _SLO_FIELDS:
            doc.setdefault("slo", {})[key] = parsed
        elif key in _MATCH_FIELDS:
            doc.setdefault("match", {})[key] = parsed
        else:
            doc[key] = parsed
    return doc


def _patch_cluster(c: TrafficCluster, change: Any, where: str) -> TrafficCluster:
    if not isinstance(change, dict):
        raise TrafficConfigError(f"{where} must be an object")
    _no_unknown(change, {"match", "slo", "priority", *_LIMIT_FIELDS}, where)
    kw: dict[str, Any] = {}
    for key, attr in _LIMIT_FIELDS.items():
        if key in change:
            kw[attr] = None if change[key] is None else _int(change[key], f"{where}.{key}", minimum=1)
    if "priority" in change:
        kw["priority"] = _int(change["priority"], f"{where}.priority")
    if "slo" in change:
        slo = change["slo"]
        if not isinstance(slo, dict):
            raise TrafficConfigError(f"{where}.slo must be a mapping")
        _no_unknown(slo, set(_SLO_FIELDS), f"{where}.slo")
        kw["slo"] = replace(
            c.slo, **{a: _seconds(slo[k], f"{where}.slo.{k}") for k, a in _SLO_FIELDS.items() if k in slo}
        )
    if "match" in change:
        kw["match"] = _match(c.match, change["match"], f"{where}.match")
    return replace(c, **kw)


def _match(m: Match, doc: Any, where: str) -> Match:
    if not isinstance(doc, dict):
        raise TrafficConfigError(f"{where} must be a mapping")
    _no_unknown(doc, set(_MATCH_FIELDS), where)
    kw: dict[str, Any] = {}
    if "header" in doc:
        h = doc["header"]
        if h is not None and (not isinstance(h, str) or not h):
            raise TrafficConfigError(f"{where}.header must be a non-empty string, got {h!r}")
        kw["header"] = h
    if "minPromptTokens" in doc:
        kw["min_prompt_tokens"] = _int(doc["minPromptTokens"], f"{where}.minPromptTokens", minimum=0)
    if "maxPromptTokens" in doc and doc["maxPromptTokens"] is not None:
        kw["max_prompt_tokens"] = _int(doc["maxPromptTokens"], f"{where}.maxPromptTokens", minimum=1)
    out = replace(m, **kw)
    if out.max_prompt_tokens is not None and out.max_prompt_tokens < out.min_prompt_tokens:
        raise TrafficConfigError(
            f"{where}.maxPromptTokens ({out.max_prompt_tokens}) must be >= minPromptTokens ({out.min_prompt_tokens})"
        )
    return out


def _no_unknown(doc: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(doc) - allowed)
    if unknown:
        prefix = f"{where}." if where else ""
        raise TrafficConfigError(f"unknown field {prefix}{unknown[0]}; allowed: {', '.join(sorted(allowed))}")


def _int(v: Any, where: str, minimum: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TrafficConfigError(f"{where} must be an integer, got {v!r}")
    if minimum is not None and v < minimum:
        raise TrafficConfigError(f"{where} must be >= {minimum}, got {v}")
    return v


def _seconds(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise TrafficConfigError(f"{where} must be > 0 (seconds), got {v!r}")
    return float(v)
