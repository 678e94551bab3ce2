"""Offline helpers over crds/sarathideployment.yaml: apply its defaults the way the API server does."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / "sarathideployment.yaml"


def schema() -> dict:
    crd = yaml.safe_load(CRD_FILE.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _default(node: dict, value):
    if node.get("type") == "object" or "properties" in node:
        if not isinstance(value, dict):
            return value
        for key, sub in (node.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = _default(sub, value[key])
        return value
    if node.get("type") == "array" and isinstance(value, list):
        return [_default(node.get("items") or {}, v) for v in value]
    return value


def defaulted_spec(spec: dict) -> dict:
    """`spec` with every CRD default filled in (nested defaults inside defaulted objects too)."""
    return _default(schema()["properties"]["spec"], copy.deepcopy(spec))
