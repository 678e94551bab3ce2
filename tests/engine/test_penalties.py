"""logit_bias, presence / frequency / repetition penalties and min_p on both samplers, against a pure-Python
reference written from the OpenAI and vLLM definitions (one token at a time, no tensors)."""

import math
import random

import pytest
import torch

from stallfree.engine.gpu_sampler import GpuSampler
from stallfree.engine.sampler import Sampler, SampleRequest
from stallfree.engine.sampling_params import SamplingParams

V = 64
SAMPLERS = [Sampler, GpuSampler]  # GpuSampler runs on CPU tensors here; tests/engine/cuda has no copy


def reference_logits(logits: list[float], prompt: list[int], outputs: list[int], p: SamplingParams):
    """The processed logits of one row, as vLLM computes them: logit_bias, then the repetition penalty on
    tokens seen in the prompt or the output, then frequency * count and presence for generated tokens."""
    out = list(logits)
    for t, b in p.logit_bias:
        out[t] += b
    seen = set(prompt) | set(outputs)
    for t in range(len(out)):
        if t in seen:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        n = outputs.count(t)
        out[t] -= p.frequency_penalty * n + p.presence_penalty * (n > 0)
    return out


def run_greedy(sampler_cls, logit_rows, prompt, params, steps):
    """Greedy sampling over fixed per-step logits; returns the tokens and the logprob rows it reported."""
    s = sampler_cls(frozenset(), seed=0)
    toks, lps = [], []
    for step in range(steps):
        req = SampleRequest("r", params, step, tuple(prompt) if step == 0 else ())
        res = s.sample(logit_rows[step].clone()[None], [req])[0]
        toks.append(res.token_id)
        lps.append(res.top_logprobs)
    return toks, lps


@pytest.mark.parametrize("sampler_cls", SAMPLERS)
@pytest.mark.parametrize(
    "kw",
    [
        {"presence_penalty": 1.5},
        {"frequency_penalty": 0.7},
        {"presence_penalty": -0.5, "frequency_penalty": 0.3},
        {"repetition_penalty": 1.8},
        {"repetition_penalty": 0.6},
        {"logit_bias": {3: 5.0, 7: -100.0}},
        {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.2, "logit_bias": {1: 2}},
    ],
)
def test_processed_logits_match_the_reference(sampler_cls, kw):
    gen = torch.Generator().manual_seed(0)
    steps = 12
    # Peaked rows so greedy would repeat the same few tokens without penalties.
    rows = torch.randn(steps, V, generator=gen) * 0.5
    rows[:, :4] += 3.0
    prompt = [2, 5, 9, 9, 40]
    p = SamplingParams(max_tokens=steps, temperature=0.0, logprobs=20, **kw)
    toks, lps = run_greedy(sampler_cls, rows, prompt, p, steps)
    for step in range(steps):
        ref = reference_logits(rows[step].tolist(), prompt, toks[:step], p)
        assert toks[step] == max(range(V), key=lambda t: ref[t])
        norm = math.log(sum(math.exp(x) for x in ref if x > -math.inf))
        got = lps[step]  # the 20 most likely tokens under the processed logits, best first
        assert [t for t, _ in got] == sorted(range(V), key=lambda t: -ref[t])[:20]
        for t, lp in got:
            assert lp == pytest.approx(ref[t] - norm, abs=1e-4)


@pytest.mark.parametrize("sampler_cls", SAMPLERS)
def test_penalties_change_what_greedy_repeats(sampler_cls):
    rows = torch.zeros(8, V)
    rows[:, 0] = 2.0
    rows[:, 1] = 1.0
    plain, _ = run_greedy(sampler_cls, rows, [5], SamplingParams(max_tokens=8, temperature=0), 8)
    assert plain == [0] * 8
    pres, _ = run_greedy(
        sampler_cls, rows, [5], SamplingParams(max_tokens=8, temperature=0, presence_penalty=1.5), 8
    )
    assert pres[:2] == [0, 1]
    rep, _ = run_greedy(
        sampler_cls, rows, [0], SamplingParams(max_tokens=8, temperature=0, repetition_penalty=2.5), 8
    )
    assert rep[0] == 1  # token 0 is in the prompt: 2.0 / 2.5 < 1.0


@pytest.mark.parametrize("sampler_cls", SAMPLERS)
def test_rows_without_the_fields_stay_bit_identical(sampler_cls):
    """A batch mixing penalised rows and plain ones: the plain rows' tokens and logprobs are exactly those
    of the same rows sampled alone."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=gen)
    plain = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5)
    pen = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5, repetition_penalty=1.5,
                         frequency_penalty=1.0, logit_bias={int(logits[1].argmax()): -50})  # fmt: skip
    alone = sampler_cls(frozenset()).sample(logits[[0, 2]].clone(), [SampleRequest("a", plain, 0),
                                                                     SampleRequest("c", plain, 0)])  # fmt: skip
    mixed_reqs = [
        SampleRequest(x, q, 0, (1, 2)) for x, q in zip("abcd", [plain, pen, plain, pen], strict=True)
    ]
    mixed = sampler_cls(frozenset()).sample(logits.clone(), mixed_reqs)
    assert [mixed[0], mixed[2]] == alone
    assert mixed[1].token_id != int(logits[1].argmax())


@pytest.mark.parametrize("sampler_cls", SAMPLERS)
def test_penalised_random_sampling_follows_the_reference_distribution(sampler_cls):
    """Draw many times from one penalised step: the frequencies match softmax(reference / temperature)."""
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(V, generator=gen)
    history = [0, 0, 3]  # generated before this step
    p = SamplingParams(max_tokens=8, temperature=0.8, presence_penalty=0.9, frequency_penalty=0.4,
                       repetition_penalty=1.2, logit_bias={5: 1.5})  # fmt: skip
    ref = reference_logits(base.tolist(), [7], history, p)
    ref_p = torch.softmax(torch.tensor(ref) / p.temperature, dim=0)
    s = sampler_cls(frozenset(), seed=3)
    n, batch = 4000, 400
    counts = torch.zeros(V)
    for b in range(n // batch):
        ids = [f"r{b}-{j}" for j in range(batch)]
        for k, t in enumerate(history):  # the history, sampled by the sampler itself from forcing rows
            forcing = torch.full((batch, V), -1e4)
            forcing[:, t] = 1e4
            prompt = (7,) if k == 0 else ()
            got = s.sample(forcing, [SampleRequest(rid, p, k, prompt) for rid in ids])
            assert {r.token_id for r in got} == {t}
        reqs = [SampleRequest(rid, p, len(history)) for rid in ids]
        for res in s.sample(base.repeat(batch, 1), reqs):
            counts[res.token_id] += 1
        for rid in ids:
            s.release(rid)
    freq = counts / n
    assert (freq - ref_p).abs().max() < 0.035
    assert 0.5 * (freq - ref_p).abs().sum() < 0.08  # total variation distance


@pytest.mark.parametrize("sampler_cls", SAMPLERS)
def test_min_p_drops_unlikely_tokens(sampler_cls):
    logits = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04] + [1e-9] * (V - 5)))
    p = SamplingParams(max_tokens=1, temperature=1.0, min_p=0.25)
    s = sampler_cls(frozenset(), seed=4)
    seen = set()
    for i in range(300):
        seen.add(s.sample(logits[None].clone(), [SampleRequest(f"r{i}", p, 0)])[0].token_id)
    assert seen == {0, 1}  # 0.1 < 0.25 * 0.5


def test_history_out_of_step_with_the_scheduler_is_an_error():
    s = Sampler(frozenset())
    p = SamplingParams(max_tokens=4, temperature=0.0, presence_penalty=1.0)
    s.sample(torch.randn(1, V), [SampleRequest("r", p, 0)])
    with pytest.raises(RuntimeError, match="penalty history"):
        s.sample(torch.randn(1, V), [SampleRequest("r", p, 3)])


def test_released_requests_leave_no_history():
    s = Sampler(frozenset())
    p = SamplingParams(max_tokens=4, temperature=0.0, frequency_penalty=1.0, repetition_penalty=1.2)
    rng = random.Random(0)
    kept = set()
    for i in range(40):
        s.sample(torch.randn(1, V), [SampleRequest(f"r{i}", p, 0, (1, 2, 3))])
        if rng.random() < 0.8:
            s.release(f"r{i}")
        else:
            kept.add(f"r{i}")
    assert set(s.penalties._history) == kept


def test_long_histories_grow_and_stay_exact():
    """A history longer than its first allocation (64 distinct tokens) keeps every count."""
    s = Sampler(frozenset())
    p = SamplingParams(max_tokens=200, temperature=0.0, frequency_penalty=0.01)
    toks = []
    for step in range(150):
        row = torch.full((1, V * 4), -1e3)
        row[0, (step * 7) % (V * 4)] = 1e3  # forced, each new
        toks.append(s.sample(row, [SampleRequest("r", p, step)])[0].token_id)
    h = s.penalties._history["r"]
    assert h.n == len(set(toks)) and h.counts[: h.n].sum() == 150
