"""What a request asks its output to match, in the shape of vLLM's `StructuredOutputsParams`.

Pure Python (no grammar engine here): `SamplingParams` carries one of these, the scheduler and the
simulator never look inside it, and the grammar is compiled only where the engine runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Exactly one constraint on the generated text.

    json: a JSON schema (a dict, or its JSON text; stored as canonical JSON text so equal schemas share
    one compiled grammar); strict=False lets objects carry properties the schema does not name.
    json_object: any JSON object. regex: the whole output matches this regular expression.
    choice: the output is one of these strings. grammar: an EBNF grammar (GBNF style, rule `root`) or,
    failing that, a Lark grammar.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    strict: bool = True

    def __post_init__(self) -> None:
        if self.json is not None:
            object.__setattr__(self, "json", canonical_schema(self.json))
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        self.validate()

    @property
    def kind(self) -> str:
        """Which constraint this is: one of KINDS."""
        for kind in KINDS:
            value = getattr(self, kind)
            if value not in (None, False):
                return kind
        raise ValueError("no constraint given")  # unreachable after validate()

    def validate(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, choice or grammar; "
                f"got {', '.join(given) or 'none'}"
            )
        if self.json is not None:
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from e
            if not isinstance(schema, dict | bool):
                raise ValueError("a JSON schema must be an object (or true/false)")
        if self.choice is not None:
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a non-empty string")


def canonical_schema(schema: Any) -> str:
    """A schema's JSON text without insignificant whitespace, the cache key of its compiled grammar.

    NOTE: keys are not sorted: the grammar emits object properties in the order the schema lists them,
    so the order the client wrote is the order the model writes.
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from e
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
