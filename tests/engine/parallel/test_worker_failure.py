"""A worker rank that dies mid-generation brings the engine down with a clear error, in bounded time."""

import os
import signal
import threading
import time

import psutil
import pytest
from parallel_helpers import make_parallel_llm, prompts_for

from stallfree.engine import LLM, SamplingParams
from stallfree.engine.executor import ExecutorFailedError
from stallfree.engine.parallel.executor import WorkerFailedError

DETECT_S = 10.0  # kill -> error, including stopping the other ranks (polls every 0.2 s, 3 s grace)


def test_killed_worker_fails_the_engine_cleanly(default_model):
    """Kill pipeline stage 0 while the sampling rank (stage 1) waits on it inside a gloo recv."""
    llm = make_parallel_llm(default_model, pp=2, token_budget=32)
    eng = llm.engine
    pids = [p.pid for p in eng.executor.procs.values()]
    target = pids[0]
    killed_at = []

    def kill():
        killed_at.append(time.monotonic())
        os.kill(target, signal.SIGKILL)

    prompts = prompts_for(default_model.tokenizer, [60, 90, 120])
    timer = threading.Timer(2.0, kill)
    timer.start()
    try:
        with pytest.raises(WorkerFailedError, match=f"died, exit code -{int(signal.SIGKILL)}"):
            llm.generate(
                prompts, SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True), use_tqdm=False
            )
        elapsed = time.monotonic() - killed_at[0]
        assert elapsed < DETECT_S, f"took {elapsed:.1f} s to notice the dead worker"
        assert eng.dead and "worker rank 0" in eng.dead
        assert not eng.has_unfinished_requests()  # every request ended (with an error)
        for pid in pids:  # the surviving rank was stopped too
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        with pytest.raises(ExecutorFailedError):  # the engine refuses new work from then on
            llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        timer.cancel()
        eng.shutdown()


def test_worker_dying_while_idle_is_noticed_by_check_health(default_model):
    llm = make_parallel_llm(default_model, pp=2)
    eng = llm.engine
    try:
        eng.check_health()  # all well
        os.kill(eng.executor.procs[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + DETECT_S
        with pytest.raises(WorkerFailedError, match="worker rank 1"):
            while time.monotonic() < deadline:
                eng.check_health()
                time.sleep(0.1)
        with pytest.raises(ExecutorFailedError):
            eng.step()
    finally:
        eng.shutdown()


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"tensor_parallel_size": 16}, "too large"),  # 9 query heads in 3 KV groups
        ({"pipeline_parallel_size": 31}, "exceeds the model's 30 layers"),
        ({"tensor_parallel_size": 0}, "positive integer"),
    ],
)
def test_impossible_layouts_are_refused_before_any_worker_starts(default_model, kw, words):
    with pytest.raises(ValueError, match=words):
        LLM(loaded_model=default_model, num_kv_blocks=16, **kw)
