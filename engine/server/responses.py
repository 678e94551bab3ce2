"""OpenAI response bodies and SSE chunks, built as plain dicts (one per streamed token: keep it cheap)."""

from __future__ import annotations

import json
import time
from typing import Any

from stallfree.engine.model.tokenizer import Tokenizer
from stallfree.engine.outputs import RequestOutput, TokenLogprob
from stallfree.engine.server.tool_calls.stream import ToolCallExtractor


def sse(obj: dict[str, Any] | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(outs: list[RequestOutput]) -> dict[str, Any]:
    """OpenAI usage of one request's choices: the prompt counted once, the completions summed.
    `prompt_tokens_details.cached_tokens` counts prompt tokens the first choice took from the prefix cache."""
    out = outs[0]
    prompt_tokens, completion_tokens = len(out.prompt_token_ids), sum(len(o.token_ids) for o in outs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


class ResponseBuilder:
    """Builds one request's bodies; `kind` is "completion" or "chat"; `n` choices, each with its index.

    `continuous_usage` (vLLM's stream_options.continuous_usage_stats) puts usage in every streamed chunk:
    the prompt and the tokens generated so far by that chunk's choice, as vLLM reports it.

    `tool_calls` (chat with tools): one reader per choice that takes the calls out of its text."""

    def __init__(
        self,
        kind: str,
        request_id: str,
        model: str,
        tokenizer: Tokenizer,
        include_usage: bool,
        *,
        n: int = 1,
        continuous_usage: bool = False,
        num_prompt_tokens: int = 0,
        tool_calls: list[ToolCallExtractor] | None = None,
    ):
        self.kind = kind
        self.tool_calls = tool_calls  # chat with tools: choice i's calls are read by tool_calls[i]
        self.id = request_id
        self.model = model
        self.tokenizer = tokenizer
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.num_prompt_tokens = num_prompt_tokens
        self.n = n
        self.created = int(time.time())
        self._text_offset = [0] * n

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # ---- logprobs ----------------------------------------------------------------------------------
    def completion_logprobs(self, lps: list[TokenLogprob] | None, index: int = 0) -> dict[str, Any] | None:
        if lps is None:
            return None
        tokens, offsets = [], []
        for lp in lps:
            tok = self._token(lp.token_id)
            tokens.append(tok)
            offsets.append(self._text_offset[index])
            self._text_offset[index] += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self._token(t): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }

    def chat_logprobs(self, lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if lps is None:
            return None

        def entry(tid: int, v: float) -> dict[str, Any]:
            tok = self._token(tid)
            return {"token": tok, "logprob": v, "bytes": list(tok.encode("utf-8"))}

        return {
            "content": [
                {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in lps
            ]
        }

    # ---- whole responses ---------------------------------------------------------------------------
    def full(self, outs: list[RequestOutput]) -> dict[str, Any]:
        """The whole response; outs[i] is choice i's final output."""
        if self.kind == "completion":
            choices = [
                {
                    "index": i,
                    "text": out.text,
                    "logprobs": self.completion_logprobs(out.logprobs, i),
                    "finish_reason": out.finish_reason,
                    "stop_reason": out.stop_reason,
                }
                for i, out in enumerate(outs)
            ]
            return {**self._head("text_completion"), "choices": choices, "usage": usage(outs)}
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": self.chat_logprobs(out.logprobs),
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
            }
            for i, out in enumerate(outs)
        ]
        if self.tool_calls is not None:
            for choice, extractor in zip(choices, self.tool_calls, strict=True):
                content, calls = extractor.message(choice["message"]["content"])
                choice["message"] = {"role": "assistant", "content": content}
                if calls:
                    choice["message"]["tool_calls"] = calls
                choice["finish_reason"] = _finish_with_calls(choice["finish_reason"], bool(calls))
        return {**self._head("chat.completion"), "choices": choices, "usage": usage(outs)}

    # ---- streaming ---------------------------------------------------------------------------------
    def _chunk(self, choice: dict[str, Any], num_generated: int = 0) -> str:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        body = {**self._head(obj), "choices": [choice]}
        if self.continuous_usage:
            body["usage"] = {
                "prompt_tokens": self.num_prompt_tokens,
                "completion_tokens": num_generated,
                "total_tokens": self.num_prompt_tokens + num_generated,
            }
        elif self.include_usage:
            body["usage"] = None
        return sse(body)

    def first_chunks(self) -> list[str]:
        """Chat streams open each choice with its role."""
        if self.kind != "chat":
            return []
        return [
            self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})
            for i in range(self.n)
        ]  # fmt: skip

    def delta_chunk(self, out: RequestOutput, index: int = 0) -> str | None:
        """Choice `index`'s chunk for this step's new text (and the finish reason when it ends), or None."""
        if not out.new_text and not out.finished and not out.new_logprobs:
            return None
        if self.kind == "chat" and self.tool_calls is not None:
            return self._tool_delta_chunks(out, index)
        finish = out.finish_reason if out.finished else None
        if self.kind == "completion":
            choice = {
                "index": index,
                "text": out.new_text,
                "logprobs": self.completion_logprobs(out.new_logprobs, index),
                "finish_reason": finish,
            }
        else:
            delta = {"content": out.new_text} if out.new_text or not out.finished else {}
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": self.chat_logprobs(out.new_logprobs),
                "finish_reason": finish,
            }
        if out.finished:
            choice["stop_reason"] = out.stop_reason
        return self._chunk(choice, len(out.token_ids))

    def _tool_delta_chunks(self, out: RequestOutput, index: int) -> str | None:
        """Content and tool_calls deltas of this step, one chunk each; the finish reason on the last."""
        assert self.tool_calls is not None  # noqa: S101 - only called with an extractor
        extractor = self.tool_calls[index]
        deltas = extractor.feed(out.new_text, final=out.finished)
        if out.finished:
            deltas.append({})
        chunks = []
        logprobs = self.chat_logprobs(out.new_logprobs)
        for i, delta in enumerate(deltas):
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs if i == 0 else None,
                                      "finish_reason": None}  # fmt: skip
            if out.finished and i == len(deltas) - 1:
                choice["finish_reason"] = _finish_with_calls(out.finish_reason, extractor.made_calls)
                choice["stop_reason"] = out.stop_reason
            chunks.append(self._chunk(choice, len(out.token_ids)))
        return "".join(chunks) or None

    def usage_chunk(self, outs: list[RequestOutput]) -> str:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return sse({**self._head(obj), "choices": [], "usage": usage(outs)})


def _finish_with_calls(finish_reason: str | None, made_calls: bool) -> str | None:
    """OpenAI's finish reason: "tool_calls" when the model stopped after calling tools."""
    return "tool_calls" if made_calls and finish_reason == "stop" else finish_reason
