"""Tokenizer, chat template and streaming detokenizer that come with a model.

Wraps a `tokenizers.Tokenizer` (from a Hugging Face tokenizer.json, or built from GGUF metadata by
`gguf_tokenizer`) with the special-token ids the engine needs and the model's Jinja chat template.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import tokenizers
from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger(__name__)

# End-of-turn / end-of-text markers of common formats (ChatML, GPT-2, Llama 3, Gemma, Llama 2 / Mistral). Whichever of
# them the vocabulary has stops generation, besides the model's EOS: a chat model that emits one is done.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "</s>",
)


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template and stop tokens."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: str | None = None,
        extra_stop_token_ids: Iterable[int] = (),
    ) -> None:
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        stops = {i for i in (eos_token_id, *extra_stop_token_ids) if i is not None}
        for text in END_OF_TURN_TOKENS:
            token_id = tokenizer.token_to_id(text)
            if token_id is not None:
                stops.add(token_id)
        self.stop_token_ids: frozenset[int] = frozenset(stops)
        self._template: Any = None  # compiled lazily: most callers never render one

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (added tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self._tok.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self._tok.id_to_token(self.eos_token_id)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens adds what the model expects around a prompt (e.g. BOS)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render a conversation with the model's chat template (a sandboxed Jinja environment).

        Raises ValueError when the model has no template or the template rejects the conversation.
        The result already holds any BOS text the template writes: encode it with add_special_tokens=False
        (or use `encode_chat`).
        """
        if not self.chat_template:
            raise ValueError("this model has no chat template: pass a plain prompt instead of messages")
        if self._template is None:
            self._template = _jinja_env().from_string(self.chat_template)
        context = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **kwargs,
        }
        try:
            return self._template.render(**context)
        except TemplateError as e:
            raise ValueError(f"the chat template rejected the messages: {e}") from e

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Prompt token ids of a conversation (template rendered, no special tokens added twice)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """The environment chat templates are written for (the one Hugging Face transformers uses)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env


CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas without ever emitting broken UTF-8.

    Decodes a small window (the tokens since the last emitted boundary) twice — without and with the
    new token — and emits the difference. While the text ends in U+FFFD (an incomplete multi-byte
    character split across tokens) nothing is emitted; the bytes are held until the character completes.
    The concatenation of all deltas plus `flush()` equals `tokenizer.decode(all generated ids)`.

    `context_ids` (e.g. the prompt's last few tokens) only seed the window, so that decoders that strip
    a leading space (SentencePiece) render the first generated token as they would mid-text.
    """

    def __init__(
        self, tokenizer: Tokenizer, context_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # A few tokens of context are enough to fix how the first new token renders; a whole prompt would
        # only make the first decode slower.
        self._ids: list[int] = list(context_ids)[-CONTEXT_TOKENS:]
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(self._ids)  # tokens before this have been emitted

    @property
    def token_ids(self) -> list[int]:
        """Every id seen so far, the (last few) context ids included."""
        return list(self._ids)

    def add(self, token_id: int) -> str:
        """Append one token id; return the newly completed text (possibly "")."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character is rendered as U+FFFD); call at the end."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)
