"""TraceLog (trace mode's JSON-lines writer): flush() returns once every record written so far is in its file."""

import json
import os

from eldr_sglang.patches.trace_log import TraceLog


def test_flush_waits_for_every_record(tmp_path):
    log = TraceLog(str(tmp_path))
    for i in range(2000):
        log.write("steps", {"batch_size": i, "unique_per_layer": [i % 7] * 8})
    assert log.flush(timeout=30.0)
    lines = (tmp_path / f"steps-{os.getpid()}.jsonl").read_text().splitlines()
    assert [json.loads(line)["batch_size"] for line in lines] == list(range(2000))


def test_flush_with_nothing_written_returns_at_once(tmp_path):
    assert TraceLog(str(tmp_path)).flush(timeout=0.0)
