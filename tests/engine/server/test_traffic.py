"""Traffic-cluster files: validation errors name the field; classification by header and prompt length."""

from __future__ import annotations

import pytest

from stallfree.engine.server.traffic import (
    TrafficConfigError,
    load_traffic_config,
    parse_cluster_flag,
    parse_traffic_config,
)

DOC = {
    "tokenBudget": 512,
    "trafficClusters": [
        {"name": "chat", "match": {"header": "chat", "maxPromptTokens": 2048}, "chunkCap": 256},
        {"name": "long", "match": {"minPromptTokens": 1000}, "chunkCap": 128, "priority": -1},
        {"name": "batch", "match": {"header": "offline"}, "maxWaiting": 1000},
    ],
}


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        ({"trafficClusters": [{"name": "a"}, {"name": "b", "slo": {"tbtP99Seconds": 0}}]},
         "trafficClusters[1].slo.tbtP99Seconds must be > 0"),
        ({"trafficClusters": [{"name": "Chat"}]}, "trafficClusters[0].name must be a DNS label"),
        ({"trafficClusters": [{"name": "a"}, {"name": "a"}]}, "trafficClusters[1].name 'a' is used twice"),
        ({"trafficClusters": [{"name": "a", "chunkCap": 0}]}, "trafficClusters[0].chunkCap must be >= 1"),
        ({"trafficClusters": [{"name": "a", "maxWaiting": "x"}]}, "trafficClusters[0].maxWaiting must be an integer"),
        ({"trafficClusters": [{"name": "a", "match": {"minPromptTokens": 9, "maxPromptTokens": 3}}]},
         "trafficClusters[0].match.maxPromptTokens (3) must be >= minPromptTokens (9)"),
        ({"trafficClusters": [{"name": "a", "chunkcap": 3}]}, "unknown field trafficClusters[0].chunkcap"),
        ({"tokenBudget": -1}, "tokenBudget must be >= 1"),
        ({"trafficClusters": {"name": "a"}}, "trafficClusters must be a list"),
    ],
)  # fmt: skip
def test_errors_name_the_field(doc, words):
    with pytest.raises(TrafficConfigError) as e:
        parse_traffic_config(doc)
    assert words in str(e.value)


def test_classification():
    cfg = parse_traffic_config(DOC)
    assert cfg.classify("chat", 100) == "chat"
    assert cfg.classify("chat", 3000) == "long", "too long for chat: falls to the length rule"
    assert cfg.classify(None, 1500) == "long"
    assert cfg.classify(None, 10) == "default"
    assert cfg.classify("offline", 5000) == "batch"
    assert cfg.classify("batch", 5) == "batch", "a cluster's name works as a header value too"
    assert cfg.classify("default", 5) == "default"
    assert cfg.classify("nope", 5) is None
    assert cfg.known_headers() == ["batch", "chat", "default", "long", "offline"]


def test_tunables_and_patch():
    cfg = parse_traffic_config(DOC)
    t = cfg.tunables()
    assert t.token_budget == 512 and t.cluster("chat").chunk_cap == 256 and t.cluster("long").priority == -1
    new = cfg.patched(
        {"tokenBudget": 128, "trafficClusters": {"chat": {"chunkCap": None, "slo": {"ttftP99Seconds": 1}}}}
    )
    assert new.token_budget == 128 and new.cluster("chat").chunk_cap is None
    assert new.cluster("chat").slo.ttft_p99 == 1.0 and new.cluster("chat").match.header == "chat"
    assert cfg.cluster("chat").chunk_cap == 256, "patches return a new config"
    with pytest.raises(KeyError):
        cfg.patched({"trafficClusters": {"nope": {}}})


def test_yaml_file_and_cli_flag(tmp_path):
    f = tmp_path / "engine.yaml"
    f.write_text(
        "tokenBudget: 300\ntrafficClusters:\n  - name: chat\n    match: {header: chat}\n    maxWaiting: 4\n"
    )
    cfg = load_traffic_config(f)
    assert cfg.token_budget == 300 and cfg.cluster("chat").max_waiting == 4
    bad = tmp_path / "bad.yaml"
    bad.write_text("trafficClusters:\n  - name: chat\n    slo: {tbtP99Seconds: -1}\n")
    with pytest.raises(TrafficConfigError, match=r"bad.yaml: trafficClusters\[0\].slo.tbtP99Seconds"):
        load_traffic_config(bad)
    assert parse_cluster_flag("name=chat,header=chat,chunkCap=256,tbtP99Seconds=0.2") == {
        "name": "chat", "match": {"header": "chat"}, "chunkCap": 256, "slo": {"tbtP99Seconds": 0.2},
    }  # fmt: skip
