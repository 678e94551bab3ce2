"""Per-request sampling parameters, in the shape vLLM users know."""

from __future__ import annotations

from dataclasses import dataclass, field

from stallfree.engine.structured.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy. `top_k` 0 or -1 disables top-k; `top_p` 1.0 disables nucleus sampling.
    `seed` makes one request's sampling reproducible whatever else shares its batches.
    `stop` strings end the output before the match (unless `include_stop_str_in_output`);
    `stop_token_ids` and the model's EOS end it after the token (the token is kept in `token_ids`,
    dropped from `text`). `logprobs=k` returns the top-k log-probabilities of every generated token
    (plus the chosen token's). `min_tokens` suppresses stop tokens until that many were generated.

    Penalties as OpenAI and vLLM define them: `presence_penalty` is subtracted from the logit of every
    token already generated, `frequency_penalty` times the number of times it was generated;
    `repetition_penalty` (> 1 discourages) divides the positive logits and multiplies the negative ones of
    every token in the prompt or the output. `logit_bias` adds a bias in [-100, 100] to the logits of the
    given token ids. `min_p` drops tokens whose probability is below `min_p` times the best one's. Order,
    as vLLM's sampler: min_tokens, logit_bias, penalties, then temperature, top-k, top-p, min-p. Greedy
    requests see the first three too. Log-probabilities are those of the processed logits (before
    temperature).

    `structured_outputs` constrains the text to a JSON schema, regex, choice or grammar (see
    stallfree.engine.structured); the request then ends where the grammar is complete.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); a dict is accepted too
    min_p: float = 0.0
    structured_outputs: StructuredOutputsParams | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        # Accept a single stop string / lists, as vLLM does; store tuples so the object stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if isinstance(self.logit_bias, dict):
            bias = tuple(sorted((int(t), float(b)) for t, b in self.logit_bias.items()))
            object.__setattr__(self, "logit_bias", bias)
        elif not isinstance(self.logit_bias, tuple):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias or ()))
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 10] (1 = off), got {self.repetition_penalty}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for t, b in self.logit_bias:
            if t < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {t}")
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b} for token {t}")

    @property
    def has_penalties(self) -> bool:
        """True when the output so far changes the logits (the sampler keeps this request's history)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1
