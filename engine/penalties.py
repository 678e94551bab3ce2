"""Logit processors that depend on the request, shared by the CPU and GPU samplers: logit_bias and the
presence / frequency / repetition penalties, as vLLM and OpenAI define them.

A penalty only changes the logits of tokens the request has seen (its prompt, for the repetition penalty,
and its output), so the work is sparse: per penalised request the sampler keeps, on the host, the distinct
token ids seen so far and how often each was generated (numpy arrays that grow by one entry per new
token). Each iteration gathers the logits of all (row, seen token) pairs of the batch in one flat index,
penalises them with a few elementwise kernels and scatters them back: O(tokens seen), not O(vocabulary),
no Python loop over tokens, no host synchronisation (the index goes up with the batch's other small
copies). Rows of requests without these fields are never touched: their logits, and so greedy outputs,
stay bit-identical.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from stallfree.engine.sampler import SampleRequest


def apply_penalties(
    x: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor, rep: torch.Tensor
) -> torch.Tensor:
    """Penalise the logits x (N,) float32 of N (row, seen token) pairs, as vLLM does: the repetition penalty
    first (every seen token: positive logits divided, negative ones multiplied), then frequency * count
    and presence for generated tokens. counts (N,) float32: times generated (0: only in the prompt);
    presence, frequency, rep (N,): each pair's row's parameters."""
    x = torch.where(x > 0, x / rep, x * rep)
    return x - frequency * counts - presence * (counts > 0)


@dataclass(slots=True)
class _History:
    """One penalised request's distinct seen tokens (ids[:n]) and how often each was generated."""

    ids: np.ndarray = field(default_factory=lambda: np.empty(64, dtype=np.int64))
    counts: np.ndarray = field(default_factory=lambda: np.zeros(64, dtype=np.float32))
    n: int = 0
    where: dict[int, int] = field(default_factory=dict)  # token id -> index into ids
    recorded: int = 0  # output tokens recorded (checked against the scheduler's count)

    def add(self, token: int, generated: bool) -> None:
        i = self.where.get(token)
        if i is None:
            if self.n == len(self.ids):
                self.ids = np.concatenate([self.ids, np.empty_like(self.ids)])
                self.counts = np.concatenate([self.counts, np.zeros_like(self.counts)])
            i = self.where[token] = self.n
            self.ids[i] = token
            self.n += 1
        if generated:
            self.counts[i] += 1


class PenaltyState:
    """The per-request history behind the penalties, and the processors applied before sampling."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._history: dict[str, _History] = {}

    def release(self, request_id: str) -> None:
        self._history.pop(request_id, None)

    def apply(self, logits: torch.Tensor, reqs: Sequence[SampleRequest]) -> torch.Tensor:
        """logits (N, V) float32, one row per request; biased and penalised in place where asked."""
        self._bias(logits, reqs)
        rows = [i for i, r in enumerate(reqs) if r.params.has_penalties]
        if not rows:
            return logits
        hists = [self._history_of(reqs[i]) for i in rows]
        lengths = np.array([h.n for h in hists], dtype=np.int64)
        if not lengths.sum():
            return logits  # nothing seen yet (first token, no repetition penalty)
        params = np.array(
            [[reqs[i].params.presence_penalty, reqs[i].params.frequency_penalty,
              reqs[i].params.repetition_penalty] for i in rows],
            dtype=np.float32,
        )  # fmt: skip
        host = np.concatenate(
            [
                np.repeat(np.array(rows, dtype=np.int64), lengths)[:, None].astype(np.float64),
                np.concatenate([h.ids[: h.n] for h in hists])[:, None].astype(np.float64),
                np.concatenate([h.counts[: h.n] for h in hists])[:, None],
                np.repeat(params, lengths, axis=0),
            ],
            axis=1,
        )  # (N, 6): row, token, count, presence, frequency, repetition; ids < 2**53 are exact in float64
        dev = to_device(torch.from_numpy(host), self.device)
        r, t = dev[:, 0].long(), dev[:, 1].long()
        counts, presence, frequency, rep = dev[:, 2:].float().unbind(1)
        logits.index_put_((r, t), apply_penalties(logits[r, t], counts, presence, frequency, rep))
        return logits

    def record(self, reqs: Sequence[SampleRequest], tokens: Sequence[int]) -> None:
        """The sampled tokens (host ints, one per row): added to the penalised requests' histories."""
        for r, tok in zip(reqs, tokens, strict=True):
            if r.params.has_penalties:
                h = self._history[r.request_id]
                h.add(tok, generated=True)
                h.recorded += 1

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

    def _history_of(self, req: SampleRequest) -> _History:
        rid = req.request_id
        h = self._history.get(rid)
        if h is not None:
            if h.recorded != req.num_output_tokens:
                raise RuntimeError(
                    f"penalty history of {rid} holds {h.recorded} tokens but the request has "
                    f"{req.num_output_tokens} outputs"
                )
            return h
        if req.num_output_tokens:
            raise RuntimeError(f"{rid} has {req.num_output_tokens} outputs but no penalty history")
        h = self._history[rid] = _History()
        if req.prompt_token_ids:
            ids = np.unique(np.asarray(req.prompt_token_ids, dtype=np.int64))
            size = max(64, 2 * len(ids))
            h.ids, h.counts, h.n = np.empty(size, dtype=np.int64), np.zeros(size, dtype=np.float32), len(ids)
            h.ids[: h.n] = ids
            h.where = dict(zip(ids.tolist(), range(h.n), strict=True))
        return h


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> device without a synchronisation (through pinned memory on CUDA)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
