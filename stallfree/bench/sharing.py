"""Workloads whose prompts share prefixes, for the prefix cache: the token ids themselves, not just lengths.

  system-prompt  every request = one fixed system prompt (--system-prompt-tokens ids, the same for all)
                 followed by a user turn of the trace's (scaled) prompt length.
  multi-turn     conversations of --turns MIN-MAX turns; each turn's prompt is the conversation so far
                 (earlier prompts and answers) plus a new user turn of the trace's length. A pool of
                 --conversations users takes turns: request i continues the conversation in slot
                 i % conversations, so a conversation's next turn arrives about `conversations` arrivals
                 later (at 1 QPS and 8 conversations: ~8 s of "think time").

NOTE: the previous answer inside a multi-turn prompt is synthetic ids of the answer's length, not what the
model generated (an open-loop load generator cannot wait for it); the prefix cache's hit is the previous
prompt. The ids are seeded, so the load generator and the simulator replay identical prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from stallfree.bench.traces import PROMPT_ID_RANGE, TraceRequest, prompt_token_ids

KINDS = ("trace", "system-prompt", "multi-turn")


@dataclass(frozen=True, slots=True)
class Sharing:
    kind: str = "trace"  # trace = no sharing: every prompt its own random ids
    system_prompt_tokens: int = 1000
    min_turns: int = 3
    max_turns: int = 6
    conversations: int = 8

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown workload {self.kind!r}; choose from {', '.join(KINDS)}")
        if self.system_prompt_tokens < 1:
            raise ValueError(f"--system-prompt-tokens must be >= 1, got {self.system_prompt_tokens}")
        if not 1 <= self.min_turns <= self.max_turns:
            raise ValueError(
                f"--turns must be MIN-MAX with 1 <= MIN <= MAX, got {self.min_turns}-{self.max_turns}"
            )
        if self.conversations < 1:
            raise ValueError(f"--conversations must be >= 1, got {self.conversations}")

    def describe(self) -> dict:
        if self.kind == "system-prompt":
            return {"kind": self.kind, "system_prompt_tokens": self.system_prompt_tokens}
        if self.kind == "multi-turn":
            return {
                "kind": self.kind,
                "turns": [self.min_turns, self.max_turns],
                "conversations": self.conversations,
            }
        return {"kind": self.kind}


def parse_turns(arg: str) -> tuple[int, int]:
    """`3-6` -> (3, 6); `4` -> (4, 4)."""
    lo, _, hi = arg.partition("-")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--turns must look like 3-6, got {arg!r}") from None


def _ids(seed: int, tag: int, index: int, n: int) -> list[int]:
    lo, hi = PROMPT_ID_RANGE
    return np.random.default_rng([seed, tag, index]).integers(lo, hi, size=n).tolist()


def apply_sharing(
    requests: tuple[TraceRequest, ...], sharing: Sharing, seed: int, max_model_len: int
) -> tuple[tuple[TraceRequest, ...], int]:
    """The requests with shared-prefix prompt ids filled in (and lengths to match); also how many were cut
    to fit max_model_len. Arrivals and output lengths are kept."""
    if sharing.kind == "trace":
        return requests, 0
    if sharing.kind == "system-prompt":
        return _system_prompt(requests, sharing, seed, max_model_len)
    return _multi_turn(requests, sharing, seed, max_model_len)


def _fit(prompt: list[int], output: int, max_model_len: int) -> tuple[list[int], int, bool]:
    """Cut the prompt's end (its own user turn) and then the output so prompt + output <= max_model_len."""
    cut = False
    if len(prompt) > max_model_len - 1:
        prompt, cut = prompt[: max_model_len - 1], True
    if len(prompt) + output > max_model_len:
        output, cut = max_model_len - len(prompt), True
    return prompt, output, cut


def _system_prompt(requests, sharing: Sharing, seed: int, max_model_len: int):
    system = _ids(seed, 4, 0, sharing.system_prompt_tokens)
    out, clipped = [], 0
    for r in requests:
        prompt, output, cut = _fit(system + prompt_token_ids(r.index, r.prompt_tokens, seed), r.output_tokens,
                                   max_model_len)  # fmt: skip
        clipped += cut
        out.append(replace(r, prompt_tokens=len(prompt), output_tokens=output, prompt_ids=tuple(prompt)))
    return tuple(out), clipped


def _multi_turn(requests, sharing: Sharing, seed: int, max_model_len: int):
    rng = np.random.default_rng([seed, 5])
    slots: list[tuple[list[int], int]] = [([], 0)] * sharing.conversations  # (history, turns left)
    out, clipped = [], 0
    for i, r in enumerate(sorted(requests, key=lambda r: r.arrival)):
        k = i % sharing.conversations
        history, left = slots[k]
        user = prompt_token_ids(r.index, r.prompt_tokens, seed)
        if left == 0 or len(history) + len(user) + r.output_tokens > max_model_len:
            history, left = [], int(rng.integers(sharing.min_turns, sharing.max_turns + 1))
        prompt, output, cut = _fit(history + user, r.output_tokens, max_model_len)
        clipped += cut
        answer = _ids(seed, 6, r.index, output)
        slots[k] = (prompt + answer, left - 1)
        out.append(replace(r, prompt_tokens=len(prompt), output_tokens=output, prompt_ids=tuple(prompt)))
    out.sort(key=lambda r: r.index)
    return tuple(out), clipped
