"""Per-request grammar state in the engine: a matcher per constrained request, advanced token by token.

The engine's step with constrained requests:
  schedule -> `attach_masks` starts filling this step's token masks in a worker thread and hands them to
  the runner through the SchedulerOutput -> forward (the fill overlaps it) -> the sampler applies them ->
  `accept` advances each matcher by its sampled token in Engine.update.
Termination: the grammar allows a stop token only where the output may end; once it accepted one the
request is done (`is_terminated`), also with ignore_eos.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch

from stallfree.engine.model.tokenizer import Tokenizer
from stallfree.engine.scheduler import SchedulerOutput
from stallfree.engine.structured.compiler import GrammarCompiler
from stallfree.engine.structured.masks import MaskBatch, TokenMask
from stallfree.engine.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


class StructuredOutputs:
    """Grammar matchers of the engine's constrained requests. Cheap until the first one arrives."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: GrammarCompiler | None = None
        self._matchers: dict[str, Any] = {}
        self._worker: ThreadPoolExecutor | None = None

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size)
        return self._compiler

    def validate(self, params: StructuredOutputsParams) -> None:
        """Compile (or find in the cache) the grammar; ValueError saying what is wrong with it."""
        self.compiler.compile(params)

    # ---- request lifecycle --------------------------------------------------------------------------
    def add(self, request_id: str, params: StructuredOutputsParams) -> None:
        compiled = self.compiler.compile(params)
        self._matchers[request_id] = self.compiler.xgr.GrammarMatcher(compiled)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher by its sampled token; False if the grammar rejects it."""
        return bool(self._matchers[request_id].accept_token(token_id))

    def is_terminated(self, request_id: str) -> bool:
        """True once the matcher accepted a stop token at a place where the output may end."""
        m = self._matchers.get(request_id)
        return m is not None and bool(m.is_terminated())

    # ---- masks ----------------------------------------------------------------------------------------
    def attach_masks(self, sched: SchedulerOutput) -> SchedulerOutput:
        """`sched` with the token masks of its constrained sampling rows (being filled in the background)."""
        if not self._matchers:
            return sched
        rids = [c.request_id for c in sched.chunks if c.sample and c.request_id in self._matchers]
        if not rids:
            return sched
        matchers = [self._matchers[r] for r in rids]
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        batch = MaskBatch(self._worker.submit(self._fill, matchers))
        return replace(sched, allowed_tokens={r: TokenMask(batch, i) for i, r in enumerate(rids)})

    def _fill(self, matchers: list[Any]) -> torch.Tensor:
        xgr = self.compiler.xgr
        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)  # (R, W) int32
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
        return bitmask
