"""Turn the last logits of each sampled request into a token (and its log-probabilities).

logit_bias and the presence / frequency / repetition penalties are batched tensor ops over the rows that
ask for them (stallfree.engine.penalties). Greedy rows take the argmax in one vectorised call. Other rows are processed one by one with their own
`torch.Generator`: a seeded request draws the same tokens whatever else shares its batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from stallfree.engine.penalties import PenaltyState
from stallfree.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_id: int
    logprob: float | None = None  # log-probability of the chosen token under the model's distribution
    top_logprobs: tuple[tuple[int, float], ...] = ()  # the `logprobs` most likely tokens, best first


class AllowedTokens(Protocol):
    """A row's token mask (structured outputs): which tokens the grammar allows next."""

    def bitmask(self) -> torch.Tensor:
        """(ceil(V / 32),) int32 on the CPU: bit t % 32 of word t // 32 set = token t allowed."""
        ...


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """What the sampler needs about one row."""

    request_id: str
    params: SamplingParams
    num_output_tokens: int
    prompt_token_ids: tuple[int, ...] = ()  # only with the first sample of a repetition-penalised request
    allowed_tokens: AllowedTokens | None = None  # structured outputs: only these tokens may be sampled

    @classmethod
    def of(cls, chunk, allowed_tokens: AllowedTokens | None = None) -> SampleRequest:
        """From a scheduler.ScheduledChunk that samples (and its grammar's mask, if it has one)."""
        return cls(
            chunk.request_id,
            chunk.sampling_params,
            chunk.num_output_tokens,
            chunk.penalty_prompt,
            allowed_tokens,
        )


def mask_disallowed(logits: torch.Tensor, reqs: list[SampleRequest]) -> torch.Tensor:
    """Set the logits of tokens outside each constrained row's mask to -inf (in place); logits (N, V).

    NOTE: rows without a mask are not touched, so unconstrained outputs are bit-identical with or without
    constrained neighbours. On CUDA the bitmask is unpacked on the device, copied without a sync.
    """
    rows = [i for i, r in enumerate(reqs) if r.allowed_tokens is not None]
    if not rows:
        return logits
    words = torch.stack([reqs[i].allowed_tokens.bitmask() for i in rows])  # type: ignore[union-attr]
    if logits.device.type == "cpu":
        # numpy, one row at a time: cheaper than torch's threaded kernels for this little work
        banned = np.unpackbits(~words.numpy().view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[1]]
        values = logits.numpy()
        for j, i in enumerate(rows):
            np.copyto(values[i], -np.inf, where=banned[j].view(np.bool_))
        return logits
    dev = logits.device
    index = torch.tensor(rows, dtype=torch.int64).pin_memory().to(dev, non_blocking=True)
    return mask_rows(logits, index, words.pin_memory().to(dev, non_blocking=True))


def mask_rows(logits: torch.Tensor, index: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """The device path of mask_disallowed: logits (N, V), index (R,) rows, words (R, ceil(V / 32)) int32."""
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, : logits.shape[1]].bool()  # (R, V)
    logits[index] = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
    return logits


class Sampler:
    def __init__(
        self, stop_token_ids: frozenset[int], seed: int = 0, device: torch.device | None = None
    ) -> None:
        self.stop_token_ids = stop_token_ids
        self._generators: dict[str, torch.Generator] = {}
        self._device = device or torch.device("cpu")
        self._default = torch.Generator(device=self._device)
        self._default.manual_seed(seed)
        self.penalties = PenaltyState(self._device)

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self.penalties.release(request_id)

    def _generator(self, req: SampleRequest) -> torch.Generator:
        if req.params.seed is None:
            return self._default
        g = self._generators.get(req.request_id)
        if g is None:
            g = torch.Generator(device=self._device)
            g.manual_seed(req.params.seed)
            self._generators[req.request_id] = g
        return g

    def _suppressed(self, req: SampleRequest) -> list[int]:
        """Stop tokens that may not be chosen yet (min_tokens)."""
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            return []
        ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            ids |= self.stop_token_ids
        return sorted(ids)

    def sample(self, logits: torch.Tensor, reqs: list[SampleRequest]) -> list[SampleResult]:
        """logits: (N, V) float32, one row per request in `reqs`."""
        logits = logits.float()
        for i, r in enumerate(reqs):
            banned = self._suppressed(r)
            if banned:
                logits[i, banned] = float("-inf")
        mask_disallowed(logits, reqs)  # the grammar first, as vLLM: penalties never revive a masked token
        logits = self.penalties.apply(logits, reqs)
        need_lp = any(r.params.logprobs is not None for r in reqs)
        logprobs = torch.log_softmax(logits, dim=-1) if need_lp else None  # (N, V)
        # Greedy for every row; sampled rows are replaced below. max(dim) is ~3x faster than argmax on CPU.
        tokens = torch.max(logits, dim=-1).indices
        for i, r in enumerate(reqs):
            if not r.params.greedy:
                tokens[i] = self._sample_row(logits[i], r.params, self._generator(r))
        token_list = tokens.tolist()
        self.penalties.record(reqs, token_list)
        results = []
        for i, r in enumerate(reqs):
            tok = token_list[i]
            if logprobs is None or r.params.logprobs is None:
                results.append(SampleResult(tok))
                continue
            row = logprobs[i]
            top: tuple[tuple[int, float], ...] = ()
            if r.params.logprobs > 0:
                vals, ids = torch.topk(row, r.params.logprobs)
                top = tuple(zip(ids.tolist(), vals.tolist(), strict=True))
            results.append(SampleResult(tok, float(row[tok]), top))
        return results

    @staticmethod
    def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
        # row: (V,) float32 logits
        row = row / p.temperature
        if p.min_p > 0:
            row = row.masked_fill(min_p_mask(row[None], torch.tensor([p.min_p]))[0], float("-inf"))
        if p.top_k > 0:
            kth = torch.topk(row, min(p.top_k, row.shape[0])).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always at least the best token).
            drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= p.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
            probs /= probs.sum()
        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p, and takes a generator.
        noise = torch.empty_like(probs).exponential_(generator=gen)
        return int(torch.argmax(probs / noise))


def min_p_mask(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """x (R, V) temperature-scaled logits, min_p (R,): True where a token's probability is below min_p
    times the best token's, i.e. x < max(x) + log(min_p) (min_p 0 masks nothing)."""
    floor = x.max(dim=-1, keepdim=True).values + torch.log(min_p.to(x.device))[:, None]
    return x < floor
