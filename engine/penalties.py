"""Logit processors that depend on the request, shared by the CPU and GPU samplers: logit_bias and the
presence / frequency / repetition penalties, as vLLM and OpenAI define them.

Batched tensor ops only (no Python loop over the vocabulary). The output history of each penalised request
lives in one device buffer of per-request slots, `counts` (S, V), updated in place with each sampled token
(one scatter-add per iteration, no host synchronisation); the prompt's tokens, needed by the repetition
penalty, are set once in `prompt` (S, V) from the scheduler's first chunk that samples. Rows of requests
without these fields are never touched: their logits, and so greedy outputs, stay bit-identical.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from stallfree.engine.sampler import SampleRequest


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """logits (R, V) float32; counts (R, V) how often each token was generated; prompt_mask (R, V) bool;
    presence, frequency, repetition (R,). Returns the penalised logits (R, V), as vLLM computes them:
    the repetition penalty first (on tokens of the prompt or the output), then frequency and presence."""
    generated = counts > 0
    rep = repetition[:, None]
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(prompt_mask | generated, scaled, logits)
    return logits - frequency[:, None] * counts - presence[:, None] * generated


class PenaltyState:
    """The per-request history behind the penalties, and the processors applied before sampling."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._slot: dict[str, int] = {}  # request id -> row of `counts` / `prompt`
        self._recorded: dict[str, int] = {}  # request id -> tokens recorded (checked against the scheduler)
        self._free: list[int] = []
        self.counts: torch.Tensor | None = None  # (S, V) float32: output token counts
        self.prompt: torch.Tensor | None = None  # (S, V) bool: the prompt's tokens

    def release(self, request_id: str) -> None:
        slot = self._slot.pop(request_id, None)
        self._recorded.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def apply(self, logits: torch.Tensor, reqs: Sequence[SampleRequest]) -> torch.Tensor:
        """logits (N, V) float32, one row per request; biased and penalised in place where asked."""
        self._bias(logits, reqs)
        rows = [i for i, r in enumerate(reqs) if r.params.has_penalties]
        if not rows:
            return logits
        slots = [self._slot_of(reqs[i], logits.shape[1]) for i in rows]
        assert self.counts is not None and self.prompt is not None  # noqa: S101 - _slot_of allocated them
        host = torch.tensor(
            [
                [p.presence_penalty, p.frequency_penalty, p.repetition_penalty]
                for p in (reqs[i].params for i in rows)
            ],
            dtype=torch.float32,
        )
        presence, frequency, repetition = to_device(host, self.device).unbind(1)
        rows_t, slots_t = (
            to_device(torch.tensor(rows), self.device),
            to_device(torch.tensor(slots), self.device),
        )
        out = apply_penalties(
            logits.index_select(0, rows_t),
            self.counts.index_select(0, slots_t),
            self.prompt.index_select(0, slots_t),
            presence,
            frequency,
            repetition,
        )
        return logits.index_copy_(0, rows_t, out)

    def record(self, reqs: Sequence[SampleRequest], tokens: torch.Tensor) -> None:
        """tokens (N,) int64 on the device: the sampled tokens, added to the penalised requests' counts."""
        rows = [i for i, r in enumerate(reqs) if r.params.has_penalties]
        if not rows or self.counts is None:
            return
        slots = [self._slot[reqs[i].request_id] for i in rows]
        for i in rows:
            self._recorded[reqs[i].request_id] += 1
        rows_t, slots_t = (
            to_device(torch.tensor(rows), self.device),
            to_device(torch.tensor(slots), self.device),
        )
        ones = torch.ones(len(rows), dtype=self.counts.dtype, device=self.device)
        self.counts.index_put_((slots_t, tokens.index_select(0, rows_t)), ones, accumulate=True)

    def _bias(self, logits: torch.Tensor, reqs: Sequence[SampleRequest]) -> None:
        rows, cols, vals = [], [], []
        for i, r in enumerate(reqs):
            for t, b in r.params.logit_bias:
                rows.append(i)
                cols.append(t)
                vals.append(b)
        if not rows:
            return
        idx = to_device(torch.tensor([rows, cols], dtype=torch.int64), self.device)
        bias = to_device(torch.tensor(vals, dtype=torch.float32), self.device)
        logits.index_put_((idx[0], idx[1]), bias, accumulate=True)

    def _slot_of(self, req: SampleRequest, vocab: int) -> int:
        rid = req.request_id
        slot = self._slot.get(rid)
        if slot is not None:
            if self._recorded[rid] != req.num_output_tokens:
                raise RuntimeError(
                    f"penalty history of {rid} holds {self._recorded[rid]} tokens but the request has "
                    f"{req.num_output_tokens} outputs"
                )
            return slot
        if req.num_output_tokens:
            raise RuntimeError(f"{rid} has {req.num_output_tokens} outputs but no penalty history")
        slot = self._free.pop() if self._free else self._grow(vocab)
        assert self.counts is not None and self.prompt is not None  # noqa: S101 - _grow allocated them
        self.counts[slot].zero_()
        self.prompt[slot].zero_()
        if req.prompt_token_ids:
            ids = to_device(torch.tensor(req.prompt_token_ids, dtype=torch.int64), self.device)
            self.prompt[slot].index_fill_(0, ids, True)
        self._slot[rid] = slot
        self._recorded[rid] = 0
        return slot

    def _grow(self, vocab: int) -> int:
        """Double the buffers; returns the first new slot (the others go to the free list)."""
        old = 0 if self.counts is None else self.counts.shape[0]
        new = max(8, 2 * old)
        counts = torch.zeros(new, vocab, dtype=torch.float32, device=self.device)
        prompt = torch.zeros(new, vocab, dtype=torch.bool, device=self.device)
        if self.counts is not None and self.prompt is not None:
            counts[:old] = self.counts
            prompt[:old] = self.prompt
        self.counts, self.prompt = counts, prompt
        self._free.extend(range(new - 1, old, -1))
        return old


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> device without a synchronisation (through pinned memory on CUDA)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
