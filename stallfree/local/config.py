"""Local mode's trust boundary: a SarathiDeployment file checked against the CRD's own schema.

What the API server would do, minus CEL: apply the schema's defaults, validate with jsonschema against
crds/sarathideployment.yaml (openAPIV3Schema), refuse unknown fields (the API server would silently prune
them; here a typo should fail loudly), then re-check the CRD's cross-field rules in Python. Every error names
the field.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import ValidationError

from stallfree.operator.spec import API_VERSION, KIND, SarathiSpec, parse_spec

_REPO = Path(__file__).resolve().parents[2]


class LocalConfigError(ValueError):
    """The file is not a valid SarathiDeployment for local mode. The message names the field."""


@dataclass(frozen=True, slots=True)
class LocalDeployment:
    name: str
    doc: dict  # the defaulted object
    spec: SarathiSpec
    source: Path


def crd_path() -> Path:
    """The CRD file: $STALLFREE_CRD, else the copy installed with the package (stallfree.crds, from crds/),
    else crds/ (or the chart's copy) next to this checkout."""
    env = os.environ.get("STALLFREE_CRD")
    candidates = [Path(env)] if env else []
    candidates += [
        Path(__file__).resolve().parents[1] / "crds" / "sarathideployment.yaml",  # a wheel: stallfree/crds/
        _REPO / "crds" / "sarathideployment.yaml",
        _REPO / "charts" / "stallfree" / "crds" / "sarathideployment.yaml",
    ]
    for p in candidates:
        if p.is_file():
            return p
    raise LocalConfigError(
        f"cannot find the SarathiDeployment CRD (looked at {', '.join(map(str, candidates))}); set STALLFREE_CRD"
    )


def crd_schema(path: Path | None = None) -> dict:
    crd = yaml.safe_load((path or crd_path()).read_text())
    for v in crd["spec"]["versions"]:
        if f"{crd['spec']['group']}/{v['name']}" == API_VERSION:
            return v["schema"]["openAPIV3Schema"]
    raise LocalConfigError(f"the CRD has no version {API_VERSION}")


def apply_defaults(obj: object, schema: dict) -> object:
    """Fill in `default`s the way the API server does: for absent properties of present objects, then
    recursively inside what is present (including the defaults just added)."""
    if isinstance(obj, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                obj[key] = apply_defaults(obj[key], sub)
    elif isinstance(obj, list) and "items" in schema:
        return [apply_defaults(x, schema["items"]) for x in obj]
    return obj


def _path(parts) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def unknown_fields(obj: object, schema: dict, at: tuple = ()) -> list[str]:
    if (
        isinstance(obj, dict)
        and "properties" in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out = []
        allowed = schema["properties"]
        for key, value in obj.items():
            if key in allowed:
                out += unknown_fields(value, allowed[key], (*at, key))
            elif "additionalProperties" not in schema:
                out.append(_path((*at, key)))
        return out
    if isinstance(obj, list) and "items" in schema:
        return [u for i, x in enumerate(obj) for u in unknown_fields(x, schema["items"], (*at, i))]
    return []


def cross_field_errors(spec: dict, meta: dict) -> list[str]:
    """The CRD's CEL rules that pydantic (stallfree.operator.spec) does not already repeat."""
    errs = []
    name = meta.get("name", "")
    if not (len(name) <= 50 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)):
        errs.append("metadata.name must be a DNS label of at most 50 characters that starts with a letter")
    slo, ctl, eng, adm = spec["slo"], spec["controller"], spec["engine"], spec["admission"]
    if slo["ttftP99Seconds"] < slo["tbtP99Seconds"]:
        errs.append("spec.slo.ttftP99Seconds must be at least slo.tbtP99Seconds")
    for key in ("ttftP99Seconds", "tbtP99Seconds", "schedulingDelayP50Seconds"):
        if slo[key] <= 0:
            errs.append(f"spec.slo.{key} must be positive")
    if ctl["windowSeconds"] < ctl["intervalSeconds"]:
        errs.append("spec.controller.windowSeconds must be >= controller.intervalSeconds")
    if adm.get("maxRunning") is not None and adm["maxRunning"] > eng["maxNumSeqs"]:
        errs.append("spec.admission.maxRunning must not exceed engine.maxNumSeqs")
    max_len = spec["model"].get("maxModelLen")
    for i, c in enumerate(spec.get("trafficClusters") or []):
        at = f"spec.trafficClusters[{i}] ({c.get('name')})"
        if c.get("maxRunning") is not None and c["maxRunning"] > eng["maxNumSeqs"]:
            errs.append(f"{at}.maxRunning must not exceed engine.maxNumSeqs ({eng['maxNumSeqs']})")
        if c.get("chunkCap") is not None and c["chunkCap"] > spec["budget"]["max"]:
            errs.append(f"{at}.chunkCap must not exceed budget.max ({spec['budget']['max']})")
        m = c.get("match") or {}
        if "minPromptTokens" in m and "maxPromptTokens" in m and m["minPromptTokens"] > m["maxPromptTokens"]:
            errs.append(f"{at}.match.minPromptTokens must be <= match.maxPromptTokens")
        if max_len and m.get("maxPromptTokens", 0) > max_len:
            errs.append(f"{at}.match.maxPromptTokens must not exceed model.maxModelLen ({max_len})")
        for key, v in (c.get("slo") or {}).items():
            if v <= 0:
                errs.append(f"{at}.slo.{key} must be positive")
    return errs


def validate(doc: object, schema: dict | None = None) -> dict:
    """The defaulted object, or LocalConfigError listing every problem with its field path."""
    import jsonschema

    if not isinstance(doc, dict):
        raise LocalConfigError("the file must hold one YAML mapping (a SarathiDeployment object)")
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != KIND:
        raise LocalConfigError(
            f"apiVersion/kind must be {API_VERSION}/{KIND}, got {doc.get('apiVersion')}/{doc.get('kind')}"
        )
    schema = schema or crd_schema()
    doc = apply_defaults(copy.deepcopy(doc), schema)
    problems = [
        f"{_path(e.absolute_path)}: {e.message}"
        for e in sorted(
            jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(map(str, e.absolute_path))
        )
    ]
    problems += [f"{p}: unknown field" for p in unknown_fields(doc, schema)]
    if problems:
        raise LocalConfigError("invalid SarathiDeployment:\n  " + "\n  ".join(problems))
    problems = cross_field_errors(doc["spec"], doc.get("metadata") or {})
    try:
        parse_spec(doc["spec"])
    except ValidationError as e:
        for err in e.errors():
            at = ".".join(["spec", *map(str, err["loc"])])
            msg = err["msg"].removeprefix("Value error, ")
            if msg not in " ".join(problems):  # the same rule may already be reported above
                problems.append(f"{at}: {msg}")
    if problems:
        raise LocalConfigError("invalid SarathiDeployment:\n  " + "\n  ".join(problems))
    src = doc["spec"]["model"]["source"]
    if src["type"] == "PersistentVolumeClaim":
        raise LocalConfigError(
            "spec.model.source.type PersistentVolumeClaim cannot run locally: use Bundled or HostPath (a local path)"
        )
    if src["type"] == "HostPath" and not Path(src["path"]).exists():
        raise LocalConfigError(f"spec.model.source.path: {src['path']} does not exist on this machine")
    return doc


def load(path: str | Path) -> LocalDeployment:
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as e:
        raise LocalConfigError(f"cannot read {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise LocalConfigError(f"{path} is not valid YAML: {e}") from e
    doc = validate(doc)
    return LocalDeployment(name=doc["metadata"]["name"], doc=doc, spec=parse_spec(doc["spec"]), source=path)
