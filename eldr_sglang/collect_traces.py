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

from eldr_sglang.cliparse import OneLineParser, fail
from eldr_sglang.core import ModelSpec, TraceDirNotEmpty, TraceRecord, TraceWriter

PROG = "eldr-collect-traces"


class InputError(ValueError):
    """Bad input; the message starts with the flag it came from."""


def read_jsonl(paths: list[Path], flag: str = "--logs") -> dict[str, dict]:
    """Records by request id (``rid``) of JSON-lines files; InputError naming ``flag``."""
    out = {}
    for path in paths:
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise InputError(f"{flag}: cannot read {path} ({exc.strerror})") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{flag}: {path}:{n}: not JSON ({exc.msg})") from None
            if not isinstance(rec, dict) or "rid" not in rec:
                raise InputError(f"{flag}: {path}:{n}: rid: required (a JSON object with the request id)")
            out[str(rec["rid"])] = rec
    return out


def model_spec(model_dir: Path) -> ModelSpec:
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise InputError(f"--model: no config.json in {model_dir}")
    try:
        return ModelSpec.from_hf_config(json.loads(cfg_path.read_text()), model_dir.name)
    except ValueError as exc:
        raise InputError(f"--model: {exc}") from None


def check_pair(rid: str, pre: dict, dec: dict, spec: ModelSpec) -> None:
    """InputError when a request's prefill or decode record lacks what a trace record needs."""
    missing = [f"prefill {k}" for k in ("layers", "counts", "prompt_tokens") if k not in pre] + [
        f"decode {k}" for k in ("decode_counts", "output_tokens") if k not in dec]
    if missing:
        raise InputError(f"--logs: request {rid}: {', '.join(missing)}: required")
    if len(pre["layers"]) != spec.num_layers:
        raise InputError(f"--logs: prefill record {rid} has layers {pre['layers']}; "
                         "trace mode needs all layers (--eldr-trace-dir without --eldr-layers)")


def join_records(prefill: dict[str, dict], decode: dict[str, dict], labels: dict[str, dict],
                 spec: ModelSpec) -> Iterator[TraceRecord]:
    """One trace record per request id present on both the prefill and the decode side."""
    for rid, pre in prefill.items():
        dec = decode.get(rid)
        if dec is None:
            continue
        check_pair(rid, pre, dec, spec)
        lab = {k: str(v) for k, v in labels.get(rid, {}).items() if k != "rid"}
        yield TraceRecord(
            rid, np.array(pre["counts"]), np.array(dec["decode_counts"]), int(pre["prompt_tokens"]),
            int(dec["output_tokens"]), lab,
            np.array(pre["gate_prob_sums"], dtype=np.float32) if "gate_prob_sums" in pre else None,
            np.array(pre["gate_logit_sums"], dtype=np.float32) if "gate_logit_sums" in pre else None)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--logs", nargs="+", type=Path, required=True, help="--eldr-trace-dir folders")
    p.add_argument("--model", type=Path, required=True, help="model folder (config.json)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--labels", type=Path, help="JSON lines with rid and label fields")
    p.add_argument("--shard-size", type=int, default=1024)
    p.add_argument("--append", action="store_true",
                   help="add to the shards already in --out (refused without it: records of two runs would mix)")
    args = p.parse_args(argv)
    try:
        joined, prefill, decode = collect(args)
    except InputError as exc:
        fail(PROG, str(exc))
    before = f"; appended to {args.existing_records} records already in {args.out}" if args.append else ""
    print(f"wrote {joined} trace records to {args.out} ({len(prefill) - joined} prefill-only, "
          f"{len(decode) - joined} decode-only records skipped{before})")
    if args.labels:
        unlabelled = sum(rid in decode and rid not in args.label_rids for rid in prefill)
        if unlabelled:
            print(f"warning: {unlabelled} of {joined} records have no line in {args.labels} (joined on rid): "
                  f"e.g. SGLang's warm-up request, or traffic sent with random rids such as bench_serving's; "
                  f"they are kept without labels", file=sys.stderr)
    return 0


def collect(args: argparse.Namespace) -> tuple[int, dict, dict]:
    """Read, join and write; (records written, prefill records, decode records)."""
    for d in args.logs:
        if not d.is_dir():
            raise InputError(f"--logs: {d} is not a directory (the servers' --eldr-trace-dir)")
    if args.shard_size < 1:
        raise InputError(f"--shard-size: expected an integer >= 1, got {args.shard_size}")
    spec = model_spec(args.model)
    labels = read_jsonl([args.labels], "--labels") if args.labels else {}
    args.label_rids = set(labels)  # main() counts the records left without a label
    prefill = read_jsonl([f for d in args.logs for f in sorted(d.glob("prefill-*.jsonl"))])
    decode = read_jsonl([f for d in args.logs for f in sorted(d.glob("decode-*.jsonl"))])
    if not prefill or not decode:
        raise InputError(f"--logs: found {len(prefill)} prefill and {len(decode)} decode records in "
                         f"{', '.join(map(str, args.logs))}; run the servers with --eldr-trace-dir")
    for rid, pre in prefill.items():  # every pair checked before anything is written
        if rid in decode:
            check_pair(rid, pre, decode[rid], spec)
    joined = 0
    try:
        writer = TraceWriter(args.out, spec, shard_size=args.shard_size, append=getattr(args, "append", False))
    except TraceDirNotEmpty as exc:
        raise InputError(f"--out: {exc}") from None
    args.existing_records = writer.existing_records
    with writer:
        for record in join_records(prefill, decode, labels, spec):
            writer.add(record)
            joined += 1
    return joined, prefill, decode


if __name__ == "__main__":
    sys.exit(main())
