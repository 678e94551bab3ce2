"""Issue 28's structure rules for the engine, as cheap static checks (STYLE.md habit 11).

- Code outside the attention registry does not branch on an attention backend's name: it asks the backend
  (its kernels, graph support, sampling). At most MAX_NAME_BRANCHES comparisons with a backend name remain.
- One metadata builder: only stallfree.engine.attention.batch turns block tables into KV-cache slots.
- One execute loop: only stallfree.engine.model_runner defines a runner's `execute`; the parallel worker runs
  that runner.

Issue 42's, as behaviour: one engine step over either executor (in process, or worker ranks: at T = P = 1
and with pipeline stages the engine is an LLMEngine whose `step` drives a ParallelExecutor, and answers as
the in-process one does), one KV sizing rule for the engine and the ranks, and one model forward (a pipeline
stage is the model class with first/last roles, which the CUDA graphs' classes take as they take a model).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from cuda_helpers import TINY

from stallfree.engine import SamplingParams
from stallfree.engine.attention import KVCache, make_backend
from stallfree.engine.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from stallfree.engine.cuda_graphs import DecodeGraphs, PiecewiseGraphs
from stallfree.engine.engine import LLMEngine, create_engine
from stallfree.engine.executor import CPU_KV_CACHE_BYTES, InProcessExecutor, KVShape, kv_cache_blocks
from stallfree.engine.model.dummy import build_dummy_model, synthetic_tokenizer
from stallfree.engine.model.llama import LlamaForCausalLM
from stallfree.engine.model.loader import LoadedModel
from stallfree.engine.parallel.executor import ParallelExecutor
from stallfree.engine.parallel.stage import build_stage

REPO = Path(__file__).parents[2]
ENGINE = REPO / "engine"
BACKEND_NAMES = {"torch", "cpu", "triton", "flashinfer"}
REGISTRY = ENGINE / "attention" / "registry.py"
MAX_NAME_BRANCHES = 3


def _sources(*roots: Path) -> list[Path]:
    return sorted(p for root in roots for p in root.rglob("*.py"))


def _names_in(node: ast.AST) -> set[str]:
    """Backend names a comparison operand spells out: a string, or a tuple / list / set of strings."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & BACKEND_NAMES
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return set().union(*(_names_in(e) for e in node.elts)) if node.elts else set()
    return set()


def backend_name_branches(path: Path) -> list[str]:
    """Comparisons with a backend name. "cpu" (also a device, a clock, a host field) counts only where the
    other side speaks of a backend or attention."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        names = set().union(*(_names_in(o) for o in operands))
        other = " ".join(ast.unparse(o) for o in operands if not _names_in(o)).lower()
        if names - {"cpu"} or (names and ("backend" in other or "attention" in other)):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_backend_name_branches_live_in_the_registry() -> None:
    found = [
        b for p in _sources(ENGINE, REPO / "stallfree") if p != REGISTRY for b in backend_name_branches(p)
    ]
    assert len(found) <= MAX_NAME_BRANCHES, (
        "branches on a backend's name outside the registry:\n" + "\n".join(found)
    )


def test_the_counter_sees_a_branch_and_ignores_device_types(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "if name == 'triton' or backend in ('cpu', 'x'):\n    pass\n"
        "if device.type == 'cpu' or clock == 'cpu':\n    pass\n"
        "if mode == 'fast':\n    pass\n"
    )
    found = backend_name_branches(probe)
    assert len(found) == 2 and all(":1:" in f for f in found), found


def test_one_metadata_builder() -> None:
    """Only the common batch reads the scheduler's block tables (the slot arithmetic); the scheduler and
    block manager, which make them, are not builders."""
    makers = {ENGINE / "scheduler.py", ENGINE / "block_manager.py"}
    readers = sorted(
        str(p.relative_to(REPO))
        for p in _sources(ENGINE)
        if p not in makers
        and any(
            isinstance(n, ast.Attribute) and n.attr == "block_table"
            for n in ast.walk(ast.parse(p.read_text()))
        )
    )
    assert readers == ["engine/attention/batch.py"], readers


def test_one_execute_loop() -> None:
    defs = sorted(
        f"{p.relative_to(REPO)}:{n.lineno}"
        for p in _sources(ENGINE)
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.FunctionDef) and n.name == "execute"
    )
    assert len(defs) == 1 and defs[0].startswith("engine/model_runner.py:"), defs
    worker = (ENGINE / "parallel" / "worker.py").read_text()
    assert "ModelRunner(" in worker, "the parallel worker must run the one ModelRunner"


def test_the_model_gets_its_kernels_from_its_caller() -> None:
    """No runner sets attributes on the model: its kernels come in as an argument."""
    setters = [
        f"{p.relative_to(REPO)}:{n.lineno}: {ast.unparse(n)}"
        for p in _sources(ENGINE)
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Attribute) and t.attr == "kernels"
    ]
    assert not setters, setters


# ---- one engine step over either executor (issue 42) ------------------------------------------------------
PROMPTS = [list(range(10, 47)), [5, 6, 7], list(range(300, 390))]


def _tiny() -> LoadedModel:
    model = build_dummy_model(TINY, torch.float32, "cpu", seed=0)
    return LoadedModel(model, synthetic_tokenizer(TINY.vocab_size), TINY, "tiny")


def _config(tp: int = 1, pp: int = 1) -> EngineConfig:
    return EngineConfig(
        device="cpu", dtype="float32", attention_backend="torch",
        parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        scheduler=SchedulerConfig(max_num_seqs=4), cache=CacheConfig(num_kv_blocks=64),
    )  # fmt: skip


def _greedy(engine: LLMEngine, steps: list[int]) -> dict[str, list[int]]:
    """Run PROMPTS to completion through engine.step (each call's batch count into `steps`)."""
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps.append(len(outs))
        done.update({o.request_id: o.token_ids for o in outs if o.finished})
    return done


@pytest.mark.parametrize("tp, pp", [(1, 1), (1, 2)], ids=["tp1xpp1", "pp2"])
def test_the_parallel_engine_is_the_engine_step_over_worker_ranks(monkeypatch, tp, pp) -> None:
    """Worker ranks (one at T = P = 1, two pipeline stages) behind the same LLMEngine.step: it drives the
    executor (submit, collect), and the greedy tokens are the in-process engine's."""
    loaded = _tiny()
    want = _greedy(LLMEngine(_config(), loaded), [])
    assert isinstance(LLMEngine(_config(), loaded).executor, InProcessExecutor)
    if tp * pp == 1:
        engine = LLMEngine(_config(tp, pp), loaded, executor_class=ParallelExecutor)
    else:
        engine = create_engine(_config(tp, pp), loaded)
    try:
        assert type(engine) is LLMEngine and isinstance(engine.executor, ParallelExecutor)
        assert engine.executor.max_in_flight == pp and len(engine.executor.procs) == tp * pp
        calls: list[str] = []
        for name in ("submit", "collect"):
            real = getattr(engine.executor, name)
            monkeypatch.setattr(
                engine.executor, name, lambda *a, _real=real, _name=name: (calls.append(_name), _real(*a))[1]
            )
        got = _greedy(engine, [])
    finally:
        engine.shutdown()
    assert got == want
    assert calls.count("submit") == calls.count("collect") > 0


def test_the_engine_and_every_rank_size_the_kv_cache_by_one_rule() -> None:
    """The in-process engine's cache is kv_cache_blocks over the whole model; a rank's is the same rule over
    its stage's layers and its shard's heads (a rank with half the layers holds twice the blocks)."""
    cache = CacheConfig(block_size=16, kv_cache_memory_gb=2**-10)  # 1 MiB
    engine = LLMEngine(
        EngineConfig(device="cpu", dtype="float32", attention_backend="torch", cache=cache), _tiny()
    )
    cpu = torch.device("cpu")
    whole = KVShape(TINY.num_layers, TINY.num_kv_heads, TINY.head_dim, 16, torch.float32)
    assert engine.num_kv_blocks == kv_cache_blocks(whole, cpu, 2**20) == 2**20 // whole.block_bytes
    half = KVShape(TINY.num_layers // 2, TINY.num_kv_heads, TINY.head_dim, 16, torch.float32)
    assert kv_cache_blocks(half, cpu, 2**20) == 2 * engine.num_kv_blocks
    assert kv_cache_blocks(whole, cpu, None) == CPU_KV_CACHE_BYTES // whole.block_bytes  # the CPU's default


# ---- one model forward (issue 42) ---------------------------------------------------------------------------
def _causal(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exact attention over one sequence without a cache; query head h reads KV head h // group."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return o.transpose(0, 1)


def test_a_pipeline_stage_is_the_model_class() -> None:
    """build_stage gives LlamaForCausalLM itself, cut to its layers, with first/last roles; chained, the stages
    compute exactly the whole model's forward; the CUDA graphs' classes take a stage as they take a model (a
    later stage's graphs read hidden states, an earlier one's end in them)."""
    full = _tiny().model
    stages = [build_stage(TINY, full.state_dict(), tp_size=1, tp_rank=0, pp_size=2, stage=s) for s in (0, 1)]
    assert all(type(st) is LlamaForCausalLM for st in stages)
    roles = [(st.first_stage, st.last_stage, st.layer_range) for st in stages]
    assert roles == [(True, False, (0, 1)), (False, True, (1, 2))]
    assert [layer.self_attn.layer_idx for st in stages for layer in st.model.layers] == [0, 0]
    ids, pos = torch.tensor([3, 1, 4, 1, 5, 9, 2]), torch.arange(7)
    with torch.inference_mode():
        x = ids
        for st in stages:
            x = st(x, pos, _causal)
        assert torch.equal(x, full(ids, pos, _causal))
    cache = KVCache(1, 4, 16, TINY.num_kv_heads, TINY.head_dim, torch.float32, "cpu")
    backend = make_backend("torch", cache, TINY.num_heads, TINY.num_kv_heads, TINY.head_dim)
    later, earlier = DecodeGraphs(stages[1], backend, [1, 2], 4), PiecewiseGraphs(stages[0], backend, [32])
    assert later.x_in is not None and later.last and earlier.x_in is None and earlier.num_layers == 1
