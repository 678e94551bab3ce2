"""Text prompts of an exact token length, for servers that take only strings (llama.cpp's server).

stallfree and vLLM accept token-id prompts, so the load generator sends ids and the length is exact. A
server that wants text gets words instead: tokens of the model's own vocabulary that are a space followed by
letters (" river", " table"), which a byte-level BPE never merges across the space, so N such words encode
back to exactly N tokens. The words are drawn per request from a seeded generator, so prompts share no
prefix and a server's prefix reuse cannot make them cheap. Every text is checked by encoding it.

EOS is suppressed with `logit_bias` (the OpenAI way), since such servers may not know `ignore_eos`; the
output length then matches what stallfree is asked for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_WORD = re.compile(r"^ [a-z]{3,12}$")


@dataclass(frozen=True, slots=True)
class TextPrompts:
    words: tuple[str, ...]
    eos_id: int | None
    tokenizer: object  # stallfree.engine.model.tokenizer.Tokenizer
    # NOTE: a capacity search replays one workload at several loads. A peer's prompt cache (llama-server
    # keeps every slot's prompt in host RAM, --cache-ram) would serve the second run's prompts from the
    # first's, and we cannot empty it as we empty our own (/admin/v1/reset_prefix_cache): each run takes
    # its own salt, so no run's prompt was ever sent before.
    salt: int = 0

    @classmethod
    def from_gguf(cls, path: str | Path | None = None) -> TextPrompts:
        """The vocabulary of a GGUF model (default: the bundled one); reads metadata, not weights."""
        from gguf import GGUFReader

        from stallfree.engine.model.gguf_loader import read_metadata
        from stallfree.engine.model.gguf_tokenizer import tokenizer_from_gguf_metadata
        from stallfree.engine.paths import default_model_path

        tok = tokenizer_from_gguf_metadata(read_metadata(GGUFReader(str(path or default_model_path()))))
        words = []
        for i in range(tok.vocab_size):
            text = tok.decode([i], skip_special_tokens=True)
            if _WORD.match(text) and tok.encode(text, add_special_tokens=False) == [i]:
                words.append(text)
        if len(words) < 500:
            raise ValueError(
                f"only {len(words)} single-token words in this vocabulary; text prompts need 500"
            )
        eos = tok.token_to_id(tok.eos_token) if tok.eos_token else None
        return cls(tuple(words), eos, tok)

    def text(self, index: int, length: int, seed: int = 0) -> str:
        """`length` tokens of text for request `index`; exact for this tokenizer (checked)."""
        rng = np.random.default_rng([seed, 3, index] if self.salt == 0 else [seed, 3, index, self.salt])
        picks = rng.integers(0, len(self.words), size=length)
        out = "".join(self.words[k] for k in picks)
        n = len(self.tokenizer.encode(out, add_special_tokens=False))  # type: ignore[attr-defined]
        if n != length:
            raise AssertionError(f"text prompt for request {index} encodes to {n} tokens, not {length}")
        return out

    def body(self, body: dict, index: int, length: int, seed: int = 0) -> dict:
        """A token-id request body turned into a text one: prompt as text, EOS banned, no stallfree-only
        fields (servers with strict schemas refuse unknown ones)."""
        out = {k: v for k, v in body.items() if k not in ("ignore_eos", "min_tokens")}
        out["prompt"] = self.text(index, length, seed)
        if self.eos_id is not None:
            out["logit_bias"] = {str(self.eos_id): -100}
        return out
