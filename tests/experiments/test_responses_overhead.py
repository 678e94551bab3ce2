"""`python -m experiments.responses_overhead`, cheap: a real server, both endpoints stream every token, the
JSON holds what the docs quote."""

import json

import pytest

from experiments.responses_overhead import count_tokens, main


@pytest.mark.slow
def test_both_endpoints_stream_and_the_ratio_is_written(tmp_path, capsys):
    assert main(["--batch", "2", "--tokens", "3", "--reps", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "responses-vs-chat-stream-cpu.json").read_text())
    assert [r["endpoint"] for r in result["rounds"]] == ["chat", "responses", "responses", "chat"]
    assert all(r["tokens"] == 6 and r["cpu_s"] >= 0 for r in result["rounds"])
    med = result["median"]
    assert (
        result["cpu_ratio_median_of_medians"]
        == med["responses"]["cpu_ms_per_token"] / med["chat"]["cpu_ms_per_token"]
    )
    ev = result["event_building_us_per_token"]
    assert len(ev["chat"]["runs"]) == len(ev["responses"]["runs"]) == 6 and ev["chat"]["median"] > 0
    assert result["event_building_ratio"] == ev["responses"]["median"] / ev["chat"]["median"]
    assert "ratio responses/chat (CPU)" in capsys.readouterr().out


def test_a_stream_that_did_not_end_well_is_an_error():
    with pytest.raises(RuntimeError, match="chat stream failed"):
        count_tokens("chat", ['data: {"choices": [{"delta": {"content": "a"}}]}'])
    with pytest.raises(RuntimeError, match="responses stream failed"):
        count_tokens("responses", ['data: {"type": "response.failed"}'])
