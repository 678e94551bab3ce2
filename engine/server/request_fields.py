"""Which request fields the server honours, which it ignores, and which it refuses.

Nothing that would change the output is dropped silently. A field is one of:
- implemented: declared on the pydantic request models in protocol.py;
- ignored: harmless here, it does not change what the model generates (bookkeeping, billing, caching hints);
- refused: it would change the output and this server does not do it; a request that sets it (to anything
  but a value that changes nothing) gets 400 naming the field, in vLLM's error shape.
Any other unknown field is ignored, as OpenAI-compatible servers do, and logged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from stallfree.engine.server.errors import BadRequest

logger = logging.getLogger(__name__)

# Fields (OpenAI's and vLLM's) that would change the output and are not implemented: why, for the 400.
REFUSED_FIELDS: dict[str, str] = {
    "functions": "function calling (functions) is not supported; it is deprecated in favour of tools",
    "function_call": "function calling (function_call) is not supported; it is deprecated in favour of tools",
    "audio": "audio output is not supported: this server generates text",
    "modalities": "only the text modality is supported",
    "prediction": "predicted outputs (prediction) are not supported",
    "web_search_options": "web search is not supported",
    "moderation": "moderation is not supported: this server does not moderate inputs or outputs",
    "reasoning_effort": "reasoning_effort is not supported: the served model has no reasoning mode",
    "verbosity": "verbosity is not supported",
    "echo": "echo is not supported",
    "suffix": "suffix is not supported",
    "best_of": "best_of is not supported (only 1); use n for several choices",
    # vLLM's extensions
    "use_beam_search": "beam search is not supported",
    "length_penalty": "length_penalty is not supported (it applies to beam search)",
    "allowed_token_ids": "allowed_token_ids is not supported; logit_bias can ban or favour tokens",
    "bad_words": "bad_words is not supported; logit_bias can ban single tokens",
    "prompt_logprobs": "prompt_logprobs is not supported",
    "truncate_prompt_tokens": "truncate_prompt_tokens is not supported: shorten the prompt",
    "logits_processors": "custom logits processors are not supported",
    "chat_template": "a per-request chat_template is not supported",
    "chat_template_kwargs": "chat_template_kwargs is not supported",
    "continue_final_message": "continue_final_message is not supported",
    "documents": "documents are not supported",
    "mm_processor_kwargs": "multimodal inputs are not supported",
    "spaces_between_special_tokens": "only spaces_between_special_tokens=true is supported",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported",
    "vllm_xargs": "vllm_xargs is not supported",
}

# Values of refused fields that change nothing (besides null/false/empty, always accepted).
INERT_VALUES: dict[str, tuple[Any, ...]] = {
    "modalities": (["text"],),
    "best_of": (1,),
    "length_penalty": (1, 1.0),
    "spaces_between_special_tokens": (True,),
    "verbosity": ("medium",),
    "truncation": ("disabled",),
}

# Harmless: they do not change what is generated.
IGNORED_FIELDS: frozenset[str] = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        # vLLM's: scheduling and caching hints, ids
        "priority",
        "request_id",
        "cache_salt",
        "add_special_tokens",
        "return_token_ids",
    }
)


def inert(name: str, value: Any) -> bool:
    """True when setting `name` to `value` changes nothing (so it needs no support)."""
    if value is None or value is False or (isinstance(value, str | list | dict) and not value):
        return True
    if isinstance(value, dict) and all(v is None for v in value.values()):  # e.g. {"effort": null}
        return True
    return any(value == v and type(value) is type(v) for v in INERT_VALUES.get(name, ()))


def refuse_unsupported(fields: Mapping[str, Any], refused: Mapping[str, str] = REFUSED_FIELDS) -> None:
    """Raise BadRequest naming the first field of `fields` (the body's fields not declared on the request
    model) that would change the output and is not implemented (`refused`: field -> why); log the unknown
    ones."""
    for name, value in fields.items():
        why = refused.get(name)
        if why is not None:
            if not inert(name, value):
                raise BadRequest(why, param=name)
        elif name not in IGNORED_FIELDS:
            logger.debug("ignoring unknown request field %r", name)
