"""``python -m eldr_sglang.placement``: per-decode-server expert placement for EP servers.

    python -m eldr_sglang.placement optimize --artifact artifact.json --traces traces/ \\
        --ep-size 4 [--redundant 0] [--batch-size 32] [--model-path MODEL] --out placements/
    python -m eldr_sglang.placement verify --model-path MODEL --ep-size 4 [--redundant 0] placements/

``optimize`` writes ``server-KK.json`` (SGLang ``--init-expert-location`` files, K =
decode server index = centroid order) and ``placement.json`` (figures: max rank load,
lower bound, gap, imbalance, distinct experts per step, against SGLang's default).
``verify`` loads each file through SGLang's own parser on CPU. Bad input ends with
``error: ...`` and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from ..core.artifact import load_artifact
from ..core.traces import ModelSpec, load_traces
from .plan import plan_per_server, write_plan
from .sglang_files import MANIFEST, parse_with_sglang, read_location_file


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eldr_sglang.placement", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    opt = sub.add_parser("optimize", help="placement files from an artifact and calibration traces")
    opt.add_argument("--artifact", required=True, help="calibration artifact JSON")
    opt.add_argument("--traces", nargs="+", required=True, help="calibration trace directories or shards")
    opt.add_argument("--ep-size", type=int, required=True, help="EP ranks per decode server")
    opt.add_argument("--redundant", type=int, default=0,
                     help="redundant expert slots (decode then needs --ep-num-redundant-experts N)")
    opt.add_argument("--batch-size", type=int, default=32, help="decode batch for the distinct-experts estimate")
    opt.add_argument("--model-path", help="model directory (config.json): check layers and experts against it")
    opt.add_argument("--out", required=True, help="output directory")
    ver = sub.add_parser("verify", help="load placement files through SGLang's parser (CPU)")
    ver.add_argument("--model-path", required=True, help="model directory with config.json")
    ver.add_argument("--ep-size", type=int, required=True)
    ver.add_argument("--redundant", type=int, default=0)
    ver.add_argument("paths", nargs="+", help="placement files or a directory of server-*.json")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        return optimize(args) if args.command == "optimize" else verify(args)
    except ValueError as exc:
        ap.error(str(exc))
    return 2


def optimize(args: argparse.Namespace) -> int:
    if args.ep_size < 1 or args.redundant < 0 or args.batch_size < 1:
        raise ValueError("--ep-size and --batch-size must be >= 1, --redundant >= 0")
    artifact = load_artifact(args.artifact)
    traces = load_traces(args.traces)
    if args.model_path:
        config = json.loads((Path(args.model_path) / "config.json").read_text())
        spec = ModelSpec.from_hf_config(config, str(args.model_path))
        if (spec.num_layers, spec.num_experts) != (artifact.model.num_layers, artifact.model.num_experts):
            raise ValueError(f"--model-path {args.model_path}: {spec.num_layers} layers x {spec.num_experts} experts, "
                             f"artifact has {artifact.model.num_layers} x {artifact.model.num_experts}")
    placements, acts = plan_per_server(artifact, traces, args.ep_size, args.redundant, args.batch_size)
    manifest = write_plan(args.out, placements, acts, ep_size=args.ep_size, num_redundant=args.redundant,
                          batch_size=args.batch_size, model=artifact.model.to_dict(),
                          source={"artifact": str(args.artifact), "artifact_checksum": artifact.checksum(),
                                  "traces": [str(t) for t in args.traces], "requests": len(traces)})
    servers = json.loads(manifest.read_text())["servers"]
    print(f"{'server':>6} {'requests':>8} {'max load':>9} {'bound':>9} {'gap':>8} {'imbalance':>9} "
          f"{'default':>9} {'distinct':>8} {'default':>8}")
    for s in servers:
        d = s["default"]
        print(f"{s['server']:>6} {s['requests']:>8} {s['max_rank_load_mean']:>9.5f} {s['lower_bound_mean']:>9.5f} "
              f"{s['gap_mean']:>8.2e} {s['imbalance_mean']:>9.4f} {d['imbalance_mean']:>9.4f} "
              f"{s['max_rank_distinct_mean']:>8.2f} {d['max_rank_distinct_mean']:>8.2f}")
    print(f"(means over layers; imbalance = max/mean rank load; distinct = expected experts read by the busiest "
          f"rank per step at batch {args.batch_size})")
    print(f"{len(servers)} placement files and {MANIFEST} written to {args.out}")
    return 0


def verify(args: argparse.Namespace) -> int:
    files: list[Path] = []
    for p in map(Path, args.paths):
        found = sorted(p.glob("server-*.json")) if p.is_dir() else [p]
        if not found or not all(f.is_file() for f in found):
            raise ValueError(f"{p}: no placement files")
        files.extend(found)
    parsed = parse_with_sglang(args.model_path, files, args.ep_size, args.redundant)
    for file, sglang_map in zip(files, parsed):
        ours = read_location_file(file)
        if ours.shape != sglang_map.shape or not np.array_equal(ours, sglang_map):
            raise ValueError(f"{file}: SGLang parsed a different map than the file holds")
        print(f"ok {file}: {sglang_map.shape[0]} layers x {sglang_map.shape[1]} physical experts, "
              f"{sglang_map.shape[1] // args.ep_size} per EP rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
