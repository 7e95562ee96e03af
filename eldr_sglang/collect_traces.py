"""Join the engine plugin's trace-mode logs into calibration trace shards.

Prefill servers write ``prefill-*.jsonl`` (prompt expert counts and gate sums),
decode servers ``decode-*.jsonl`` (decode expert counts); both carry the
request id. Requests present on both sides become one trace record.

    python -m eldr_sglang.collect_traces --logs DIR [DIR ...] --model MODEL_DIR --out traces/ \
        [--labels labels.jsonl]   # lines {"rid": ..., "task": ..., "language": ...}
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterator

import numpy as np

from eldr_sglang.core import ModelSpec, TraceRecord, TraceWriter


def read_jsonl(paths: list[Path]) -> dict[str, dict]:
    out = {}
    for path in paths:
        for n, line in enumerate(path.open(), 1):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SystemExit(f"collect_traces: {path}:{n}: not JSON ({exc})")
            out[str(rec["rid"])] = rec
    return out


def model_spec(model_dir: Path) -> ModelSpec:
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise SystemExit(f"collect_traces: --model: no config.json in {model_dir}")
    try:
        return ModelSpec.from_hf_config(json.loads(cfg_path.read_text()), model_dir.name)
    except ValueError as exc:
        raise SystemExit(f"collect_traces: --model: {exc}")


def join_records(prefill: dict[str, dict], decode: dict[str, dict], labels: dict[str, dict],
                 spec: ModelSpec) -> Iterator[TraceRecord]:
    """One trace record per request id present on both the prefill and the decode side."""
    for rid, pre in prefill.items():
        dec = decode.get(rid)
        if dec is None:
            continue
        if len(pre["layers"]) != spec.num_layers:
            raise SystemExit(f"collect_traces: prefill record {rid} has layers {pre['layers']}; "
                             "trace mode needs all layers (--eldr-trace-dir without --eldr-layers)")
        lab = {k: str(v) for k, v in labels.get(rid, {}).items() if k != "rid"}
        yield TraceRecord(
            rid, np.array(pre["counts"]), np.array(dec["decode_counts"]), int(pre["prompt_tokens"]),
            int(dec["output_tokens"]), lab,
            np.array(pre["gate_prob_sums"], dtype=np.float32) if "gate_prob_sums" in pre else None,
            np.array(pre["gate_logit_sums"], dtype=np.float32) if "gate_logit_sums" in pre else None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--logs", nargs="+", type=Path, required=True, help="--eldr-trace-dir folders")
    p.add_argument("--model", type=Path, required=True, help="model folder (config.json)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--labels", type=Path, help="JSON lines with rid and label fields")
    p.add_argument("--shard-size", type=int, default=1024)
    args = p.parse_args(argv)
    spec = model_spec(args.model)
    prefill = read_jsonl([f for d in args.logs for f in sorted(d.glob("prefill-*.jsonl"))])
    decode = read_jsonl([f for d in args.logs for f in sorted(d.glob("decode-*.jsonl"))])
    labels = read_jsonl([args.labels]) if args.labels else {}
    if not prefill or not decode:
        raise SystemExit(f"collect_traces: found {len(prefill)} prefill and {len(decode)} decode records in "
                         f"{', '.join(map(str, args.logs))}; run the servers with --eldr-trace-dir")
    with TraceWriter(args.out, spec, shard_size=args.shard_size) as writer:
        joined = 0
        for record in join_records(prefill, decode, labels, spec):
            writer.add(record)
            joined += 1
    print(f"wrote {joined} trace records to {args.out} ({len(prefill) - joined} prefill-only, "
          f"{len(decode) - joined} decode-only records skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
