"""Turns sampled tokens into text, applies stop conditions and builds RequestOutputs.

Per request it keeps an incremental detokenizer and the text so far. With stop strings, the last
`max(len(stop)) - 1` characters are held back until they can no longer start a stop string, so a streaming
client never sees text that is later cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stallfree.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from stallfree.engine.outputs import RequestMetrics, RequestOutput, TokenLogprob
from stallfree.engine.request import Request, RequestStatus
from stallfree.engine.sampler import SampleResult


@dataclass(slots=True)
class _TextState:
    detok: IncrementalDetokenizer
    text: str = ""
    emitted: int = 0  # characters of `text` already handed out as deltas
    logprobs: list[TokenLogprob] | None = None
    emitted_tokens: int = 0
    emitted_logprobs: int = 0
    hold: int = 0
    stops: tuple[str, ...] = field(default_factory=tuple)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._states: dict[str, _TextState] = {}

    def add(self, req: Request) -> None:
        p = req.sampling_params
        context = req.prompt_token_ids[-4:]
        self._states[req.request_id] = _TextState(
            detok=IncrementalDetokenizer(self.tokenizer, context, skip_special_tokens=p.skip_special_tokens),
            logprobs=[] if p.logprobs is not None else None,
            hold=max((len(s) for s in p.stop), default=1) - 1,
            stops=p.stop,
        )

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def append_token(self, req: Request, res: SampleResult, now: float) -> RequestStatus | None:
        """Record one sampled token; return the finished status if it ends the request, else None."""
        st = self._states[req.request_id]
        p = req.sampling_params
        tok = res.token_id
        req.output_token_ids.append(tok)
        req.token_times.append(now)
        if req.first_token_time is None:
            req.first_token_time = now
        if st.logprobs is not None and res.logprob is not None:
            st.logprobs.append(TokenLogprob(tok, res.logprob, res.top_logprobs))
        n_out = len(req.output_token_ids)
        # Stop tokens end the request after the token; it stays in token_ids but not in the text.
        if tok in p.stop_token_ids and n_out >= p.min_tokens:
            req.stop_reason = tok
            st.text += st.detok.flush()
            return RequestStatus.FINISHED_STOPPED
        if not p.ignore_eos and tok in self.tokenizer.stop_token_ids and n_out >= p.min_tokens:
            st.text += st.detok.flush()
            return RequestStatus.FINISHED_STOPPED
        before = len(st.text)
        st.text += st.detok.add(tok)
        if st.stops and n_out >= p.min_tokens:
            # Only a match that overlaps the new text can be new.
            search_from = max(0, before - st.hold)
            hit = min(
                ((i, s) for s in st.stops if (i := st.text.find(s, search_from)) >= 0),
                default=None,
            )
            if hit is not None:
                i, s = hit
                st.text = st.text[: i + len(s)] if p.include_stop_str_in_output else st.text[:i]
                st.emitted = min(st.emitted, len(st.text))
                req.stop_reason = s
                return RequestStatus.FINISHED_STOPPED
        if n_out >= p.max_tokens or req.num_tokens >= self.max_model_len:
            st.text += st.detok.flush()
            return RequestStatus.FINISHED_LENGTH
        return None

    def make_output(self, req: Request) -> RequestOutput:
        """The request's cumulative output plus what changed since the last call."""
        st = self._states.get(req.request_id)
        finished = req.status.finished
        if st is None:  # never detokenized (aborted or failed before any token)
            text, new_text, logprobs, new_lp, new_ids = "", "", None, None, list(req.output_token_ids)
        else:
            visible = len(st.text) if finished else max(st.emitted, len(st.text) - st.hold)
            text = st.text
            new_text = st.text[st.emitted : visible]
            st.emitted = visible
            new_ids = req.output_token_ids[st.emitted_tokens :]
            st.emitted_tokens = len(req.output_token_ids)
            logprobs = st.logprobs
            new_lp = None
            if logprobs is not None:
                new_lp = logprobs[st.emitted_logprobs :]
                st.emitted_logprobs = len(logprobs)
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=text,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=req.status.value if finished else None,
            traffic_cluster=req.traffic_cluster,
            stop_reason=req.stop_reason,
            logprobs=list(logprobs) if logprobs is not None else None,
            new_logprobs=new_lp,
            num_cached_tokens=req.num_cached_tokens,
            error=req.error,
            metrics=_metrics(req) if finished else None,
        )


def _metrics(req: Request) -> RequestMetrics:
    return RequestMetrics(
        arrival_time=req.arrival_time,
        first_scheduled_time=req.first_scheduled_time,
        first_token_time=req.first_token_time,
        finish_time=req.finish_time,
        token_times=tuple(req.token_times),
        num_preemptions=req.num_preemptions,
    )
