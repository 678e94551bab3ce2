"""Compile a request's constraint into a grammar over the model's tokens (xgrammar), once per constraint.

The grammar engine is imported here only, and only when the first constrained request arrives: an engine
that never sees one never loads it.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from typing import Any

from stallfree.engine.model.tokenizer import Tokenizer
from stallfree.engine.structured.params import StructuredOutputsParams
from stallfree.engine.structured.vocab import adds_prefix_space, token_bytes

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)
COMPILER_THREADS = 2
_LOG_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def import_xgrammar() -> Any:
    try:
        import xgrammar  # noqa: PLC0415 - heavy, and only needed by constrained requests
    except ImportError as e:
        raise ValueError(
            "structured outputs need the xgrammar package: pip install 'stallfree[engine]' (or xgrammar)"
        ) from e
    return xgrammar


class GrammarCompiler:
    """Turns StructuredOutputsParams into compiled grammars; thread-safe, with an LRU cache.

    `vocab_size` is the model's logit width (it may exceed the tokenizer's: padded rows are never allowed).
    `any_whitespace=False` (the default) makes JSON compact (", " and ": " separators, no newlines): a small
    model allowed any whitespace may fill its whole budget with newlines.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, any_whitespace: bool = False) -> None:
        xgr = import_xgrammar()
        self.xgr = xgr
        self.vocab_size = vocab_size
        self.any_whitespace = any_whitespace
        self.tokenizer_info = xgr.TokenizerInfo(
            token_bytes(tokenizer),
            xgr.VocabType.RAW,
            vocab_size=max(vocab_size, tokenizer.vocab_size),
            stop_token_ids=sorted(tokenizer.stop_token_ids),
            add_prefix_space=adds_prefix_space(tokenizer),
        )
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=COMPILER_THREADS)
        self._cache: OrderedDict[StructuredOutputsParams, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (an xgrammar CompiledGrammar); ValueError naming what is wrong with it."""
        with self._lock:
            hit = self._cache.get(params)
            if hit is not None:
                self._cache.move_to_end(params)
                return hit
        compiled = self._compile(params)
        with self._lock:
            self._cache[params] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, p: StructuredOutputsParams) -> Any:
        c = self._compiler
        kind = p.kind
        try:
            if kind == "json":
                return c.compile_json_schema(
                    p.json, any_whitespace=self.any_whitespace, strict_mode=p.strict
                )  # fmt: skip
            if kind == "json_object":
                return c.compile_json_schema(
                    '{"type": "object"}', any_whitespace=self.any_whitespace, strict_mode=False
                )  # fmt: skip
            if kind == "regex":
                return c.compile_regex(p.regex)
            if kind == "choice":
                return c.compile_grammar(choice_ebnf(p.choice or ()))
            return self._compile_grammar(p.grammar or "")
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and its own types on bad input
            raise ValueError(f"invalid {kind} constraint: {_first_line(e)}") from e

    def _compile_grammar(self, text: str) -> Any:
        try:
            return self._compiler.compile_grammar(text)
        except Exception as ebnf_error:  # noqa: BLE001 - then it may be a Lark grammar
            try:
                return self._compiler.compile_lark(text)
            except Exception:  # noqa: BLE001 - report the EBNF error: EBNF is the documented format
                raise ValueError(
                    f"invalid grammar (expected EBNF with a `root` rule, or Lark): {_first_line(ebnf_error)}"
                ) from ebnf_error


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly these strings."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _first_line(e: Exception) -> str:
    """The grammar engine's message without its log prefix ("[08:20:38] /project/cpp/x.cc:94: ")."""
    text = str(e).strip() or type(e).__name__
    return _LOG_PREFIX.sub("", text.splitlines()[0])[:500]
