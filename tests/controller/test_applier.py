"""The one applier of both modes, against engines' real admin API over HTTP (FakeEngine: the same PATCH
/admin/v1/config and bearer token as `stallfree serve`; it records every PATCH it took).

A write goes out only to an engine that does not run the settings yet: a repeated document writes
nothing, a new incarnation (restart) gets it again, a failed PATCH is tried again on the next call.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_engine import FakeEngine
from promserver import free_port

from stallfree.operator.controller.applier import ApplyFailed, EngineApplier, Target
from stallfree.operator.controller.types import Knobs, Settings

TOKEN = "applier-test-token"
TUNED = Settings(384, 1, {"chat": Knobs(256, 64, None), "summarization": Knobs(256, 8, None)})
LOWER = Settings(256, 1, TUNED.clusters)


@pytest.fixture
def engines() -> Iterator[list[FakeEngine]]:
    started = [FakeEngine(admin_token=TOKEN) for _ in range(2)]
    yield started
    for e in started:
        e.close()


def base(e: FakeEngine) -> str:
    return f"http://{e.target}"


def test_only_engines_that_lack_the_settings_are_written(engines):
    a, b = engines
    keys = {base(a): "a#0", base(b): "b#0"}
    applier = EngineApplier(lambda: [Target(u, key=k) for u, k in keys.items()], TOKEN)
    applier(TUNED)
    assert [len(e.patches) for e in engines] == [1, 1]
    assert a.config["tokenBudget"] == b.config["tokenBudget"] == 384
    for _ in range(3):  # holds: the same settings again
        applier(TUNED)
    assert [len(e.patches) for e in engines] == [1, 1]
    keys[base(b)] = "b#1"  # b restarted (a new incarnation: it read its config file afresh)
    applier(TUNED)
    assert [len(e.patches) for e in engines] == [1, 2]
    applier(LOWER)  # a change goes to everyone
    assert [len(e.patches) for e in engines] == [2, 3]
    assert a.patches[-1] == b.patches[-1] == LOWER.engine_patch()


def test_a_refused_patch_is_named_and_sent_again(engines):
    a, b = engines
    applier = EngineApplier(lambda: [Target(base(a), "engine-a"), Target(base(b), "engine-b")], TOKEN)
    b.admin_error = 503
    with pytest.raises(ApplyFailed, match=r"^engine-b: .*503") as e:
        applier(TUNED)
    assert "engine-a" not in str(e.value)
    assert (len(a.patches), len(b.patches)) == (1, 0)
    b.admin_error = None
    applier(TUNED)  # the same settings: only the engine that refused them is written
    assert (len(a.patches), len(b.patches)) == (1, 1)


def test_the_token_is_looked_up_only_to_write_and_a_wrong_one_fails(engines):
    a, _ = engines
    lookups = []

    def token() -> str:
        lookups.append(1)
        return TOKEN

    applier = EngineApplier(lambda: [Target(base(a))], token)
    applier(TUNED)
    applier(TUNED)
    assert len(lookups) == 1 and len(a.patches) == 1
    with pytest.raises(ApplyFailed, match="401"):
        EngineApplier(lambda: [Target(base(a))], "wrong")(LOWER)
    assert len(a.patches) == 1


def test_engines_no_longer_listed_are_forgotten_and_an_unreachable_one_is_named(engines):
    a, _ = engines
    listed = [Target(base(a))]
    applier = EngineApplier(lambda: listed, TOKEN)
    applier(TUNED)
    listed.clear()  # a replica gone (scaled in, or not ready) ...
    applier(TUNED)
    assert applier.applied == {}
    listed.append(Target(base(a)))  # ... and back under the same key: sent again
    applier(TUNED)
    assert len(a.patches) == 2
    applier.forget(base(a))  # a restart the caller knows of
    applier(TUNED)
    assert len(a.patches) == 3
    nobody = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ApplyFailed, match=rf"^{nobody}: "):
        EngineApplier(lambda: [Target(nobody)], TOKEN)(TUNED)
