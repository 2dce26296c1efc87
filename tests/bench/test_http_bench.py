"""`bench/http.py` end to end at tiny scale: the ZeroMQ client and the HTTP front, each against a
service of its own, on the tiny model; and how a level's figures are read from its record."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("httpx2")

from bench.http import main, markdown_table, summary  # noqa: E402


def test_both_sides_stream_every_token_and_the_run_is_written(tiny_model_dir, tmp_path):
    out = tmp_path / "http.json"
    assert main(["--model", tiny_model_dir, "--streams", "1", "2", "--min-requests", "2", "--output-len", "8",
                 "--skip-null", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {(r["side"], r["streams"]): r for r in result["rows"]}
    assert set(rows) == {(side, n) for side in ("zmq", "http") for n in (1, 2)}
    for r in rows.values():  # EOS ignored: every request gives all its tokens, on either side
        assert r["num_requests"] == 2 and r["output_tokens"] == 2 * 8 and r["output_tok_s"] > 0
        assert r["ttft_p50_ms"] > 0 and r["itl_p50_ms"] >= 0
        # The service's own processes, found below `nanovllm serve` by their modules (CPU time
        # counts in clock ticks: a tiny run may spend none of them in a process, so no figure is
        # asserted positive).
        assert {"engine", "tokenizer", "detok", "front"} <= set(r["cores"])
        assert r["server_cores"] == pytest.approx(sum(r["cores"].values()), abs=0.01)
    for s in result["summary"]:
        ratio = rows[("http", s["streams"])]["output_tok_s"] / rows[("zmq", s["streams"])]["output_tok_s"]
        assert s["http_over_zmq"] == pytest.approx(ratio, abs=1e-3) and "vllm" not in s
    assert markdown_table(result["summary"]).count("\n") == 3  # header, rule, two levels


def test_itl_is_each_requests_mean_gap_per_token():
    # Three requests of 3 tokens; the second's first two events were read together (a gap of 0).
    record = [(0.9, [1.0, 1.1, 1.2], 3), (1.5, [2.0, 2.0, 2.6], 3), (0.0, [0.2, 0.4, 0.6], 3)]
    got = summary(record, elapsed=3.0, concurrency=3)
    assert got["output_tokens"] == 9 and got["output_tok_s"] == 3.0
    assert got["ttft_p50_ms"] == pytest.approx(200.0)  # of 100, 500 and 200 ms
    assert got["itl_p50_ms"] == pytest.approx(200.0)  # of 100, 300 and 200 ms per token
