"""Per-request expert-activation traces: record, columnar npz shards, reader.

On disk a trace set is a directory of shards ``shard-00000.npz``, ``shard-00001.npz``
... plus ``meta.json`` (model name, num_layers, num_experts, top_k). Each shard holds
stacked columns for ``n`` requests:

=================  ===========  ==========================================
field              shape        dtype
=================  ===========  ==========================================
request_id         [n]          unicode
prefill_counts     [n, L, E]    integer (prefill tokens whose top-k has e)
decode_counts      [n, L, E]    integer (decode steps whose top-k has e)
prompt_tokens      [n]          integer
output_tokens      [n]          integer
label_<kind>       [n]          unicode, optional ("" = unknown)
gate_prob_sums     [n, L, E]    float32, optional (sum of gate softmax)
gate_logit_sums    [n, L, E]    float32, optional (sum of raw gate logits)
meta               []           unicode JSON, copy of meta.json
=================  ===========  ==========================================

Counts are held as int32 in memory. Every reader check raises ``ValueError`` naming
the file and the field.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

import numpy as np

META_FILE = "meta.json"
SHARD_PATTERN = "shard-{:05d}.npz"
COUNT_FIELDS = ("prefill_counts", "decode_counts")
GATE_FIELDS = ("gate_prob_sums", "gate_logit_sums")
TOKEN_FIELDS = ("prompt_tokens", "output_tokens")
LABEL_PREFIX = "label_"


@dataclass(frozen=True)
class ModelSpec:
    """Identity of the MoE model a trace or artifact belongs to."""

    name: str
    num_layers: int
    num_experts: int
    top_k: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_hf_config(cls, cfg: Mapping, name: str) -> "ModelSpec":
        """From a Hugging Face MoE ``config.json`` (Qwen3-MoE, Mixtral, DeepSeek, GPT-OSS spellings)."""
        cfg = cfg.get("text_config", cfg)
        experts = next((cfg[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if cfg.get(k)), None)
        if experts is None or "num_hidden_layers" not in cfg or "num_experts_per_tok" not in cfg:
            raise ValueError(f"{name}: config.json is not an MoE config (needs num_hidden_layers, "
                             "num_experts/num_local_experts/n_routed_experts, num_experts_per_tok)")
        return cls(name, int(cfg["num_hidden_layers"]), int(experts), int(cfg["num_experts_per_tok"]))

    @classmethod
    def from_dict(cls, d: Mapping, source: str = "meta") -> "ModelSpec":
        missing = [k for k in ("name", "num_layers", "num_experts", "top_k") if k not in d]
        if missing:
            raise ValueError(f"{source}: missing model field(s) {missing}")
        try:
            spec = cls(str(d["name"]), int(d["num_layers"]), int(d["num_experts"]), int(d["top_k"]))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: bad model field value ({exc})") from None
        if spec.num_layers <= 0 or spec.num_experts <= 0 or not 0 < spec.top_k <= spec.num_experts:
            raise ValueError(f"{source}: invalid model dimensions {spec.to_dict()}")
        return spec


@dataclass
class TraceRecord:
    """One request: expert counts [L, E] for prefill and decode, plus extras."""

    request_id: str
    prefill_counts: np.ndarray
    decode_counts: np.ndarray
    prompt_tokens: int
    output_tokens: int
    labels: dict[str, str] = field(default_factory=dict)
    gate_prob_sums: np.ndarray | None = None
    gate_logit_sums: np.ndarray | None = None


@dataclass
class TraceSet:
    """Columnar arrays for N requests (see module docstring for shapes)."""

    model: ModelSpec
    request_ids: np.ndarray
    prefill_counts: np.ndarray
    decode_counts: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    labels: dict[str, np.ndarray] = field(default_factory=dict)
    gate_prob_sums: np.ndarray | None = None
    gate_logit_sums: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.prefill_counts.shape[0])

    def subset(self, index: np.ndarray | slice) -> "TraceSet":
        """Rows selected by ``index`` (a view where numpy allows)."""
        pick = lambda a: None if a is None else a[index]  # noqa: E731
        return TraceSet(
            model=self.model,
            request_ids=self.request_ids[index],
            prefill_counts=self.prefill_counts[index],
            decode_counts=self.decode_counts[index],
            prompt_tokens=self.prompt_tokens[index],
            output_tokens=self.output_tokens[index],
            labels={k: v[index] for k, v in self.labels.items()},
            gate_prob_sums=pick(self.gate_prob_sums),
            gate_logit_sums=pick(self.gate_logit_sums),
        )

    def to_columns(self) -> dict[str, np.ndarray]:
        cols = {
            "request_id": np.asarray(self.request_ids, dtype=str),
            "prefill_counts": self.prefill_counts,
            "decode_counts": self.decode_counts,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
        }
        cols.update({LABEL_PREFIX + k: np.asarray(v, dtype=str) for k, v in self.labels.items()})
        for name in GATE_FIELDS:
            if getattr(self, name) is not None:
                cols[name] = getattr(self, name)
        return cols


def concat_traces(parts: Sequence[TraceSet]) -> TraceSet:
    """Concatenate trace sets of one model; optional columns must agree."""
    if not parts:
        raise ValueError("no traces to concatenate")
    first = parts[0]
    for p in parts[1:]:
        if p.model != first.model:
            raise ValueError(f"model mismatch: {p.model} vs {first.model}")
        if set(p.labels) != set(first.labels):
            raise ValueError(f"label kinds differ: {sorted(p.labels)} vs {sorted(first.labels)}")
        for name in GATE_FIELDS:
            if (getattr(p, name) is None) != (getattr(first, name) is None):
                raise ValueError(f"field '{name}' present in some shards only")
    cat = lambda name: np.concatenate([getattr(p, name) for p in parts])  # noqa: E731
    return TraceSet(
        model=first.model,
        request_ids=cat("request_ids"),
        prefill_counts=cat("prefill_counts"),
        decode_counts=cat("decode_counts"),
        prompt_tokens=cat("prompt_tokens"),
        output_tokens=cat("output_tokens"),
        labels={k: np.concatenate([p.labels[k] for p in parts]) for k in first.labels},
        gate_prob_sums=None if first.gate_prob_sums is None else cat("gate_prob_sums"),
        gate_logit_sums=None if first.gate_logit_sums is None else cat("gate_logit_sums"),
    )


SHARD_NAME = re.compile(r"shard-(\d{5,})\.npz")


class TraceDirNotEmpty(ValueError):
    """The output directory already holds trace shards and the caller did not ask to append."""


def existing_shards(out_dir: str | os.PathLike) -> tuple[list[Path], int]:
    """The complete shards in ``out_dir`` (``shard-NNNNN.npz``, not a ``.tmp.npz`` cut short) and their records."""
    d = Path(out_dir)
    if not d.is_dir():
        return [], 0
    shards = sorted(p for p in d.iterdir() if SHARD_NAME.fullmatch(p.name))
    records = 0
    for p in shards:
        try:
            with np.load(p) as z:
                records += len(z["request_id"])
        except Exception as exc:  # noqa: BLE001 - counted for a message only; the reader names the fault
            raise ValueError(f"{p}: unreadable trace shard ({exc})") from None
    return shards, records


class TraceWriter:
    """Buffer records and write them as npz shards of ``shard_size`` requests.

    Use as a context manager (``close`` flushes the last partial shard)::

        with TraceWriter("traces/", model, shard_size=1024) as w:
            w.add(record)

    A directory that already holds shards is refused (``TraceDirNotEmpty``, naming
    how many records are there) unless ``append=True``: a re-run into the same
    folder would otherwise add its records to the earlier run's. The check runs
    once, when the writer is made; the writer's own shards never trip it.
    ``existing_shards`` / ``existing_records`` say what was there before.
    """

    def __init__(self, out_dir: str | os.PathLike, model: ModelSpec, shard_size: int = 1024,
                 append: bool = False):
        if shard_size <= 0:
            raise ValueError("shard_size must be positive")
        self.out_dir = Path(out_dir)
        self.model = model
        self.shard_size = shard_size
        shards, records = existing_shards(self.out_dir)
        if shards and not append:
            raise TraceDirNotEmpty(
                f"{self.out_dir} already holds {len(shards)} trace shards ({records} records); "
                f"write to an empty directory, or append to them explicitly (append=True, --append)")
        self.existing_shards, self.existing_records = len(shards), records
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._buffer: list[TraceRecord] = []
        self._next_shard = 1 + max((int(SHARD_NAME.fullmatch(p.name).group(1)) for p in shards), default=-1)
        self.paths: list[Path] = []
        meta_path = self.out_dir / META_FILE
        if meta_path.exists():
            existing = ModelSpec.from_dict(json.loads(meta_path.read_text()), str(meta_path))
            if existing != model:
                if shards:
                    raise ValueError(f"{meta_path}: holds model {existing}, writer has {model}")
                meta_path.write_text(json.dumps(model.to_dict(), indent=2) + "\n")  # no shard of it left
        else:
            meta_path.write_text(json.dumps(model.to_dict(), indent=2) + "\n")

    def add(self, record: TraceRecord) -> None:
        shape = (self.model.num_layers, self.model.num_experts)
        for name in COUNT_FIELDS + GATE_FIELDS:
            value = getattr(record, name)
            if value is not None and np.shape(value) != shape:
                raise ValueError(f"record {record.request_id}: field '{name}' has shape {np.shape(value)}, expected {shape}")
        self._buffer.append(record)
        if len(self._buffer) >= self.shard_size:
            self.flush()

    def add_set(self, traces: TraceSet) -> None:
        """Write a whole TraceSet (split into shards)."""
        self.flush()
        for start in range(0, len(traces), self.shard_size):
            self._write(traces.subset(slice(start, start + self.shard_size)))

    def flush(self) -> None:
        if self._buffer:
            self._write(_records_to_set(self._buffer, self.model))
            self._buffer = []

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write(self, traces: TraceSet) -> None:
        path = self.out_dir / SHARD_PATTERN.format(self._next_shard)
        tmp = path.with_suffix(".tmp.npz")
        np.savez_compressed(tmp, meta=np.array(json.dumps(self.model.to_dict())), **traces.to_columns())
        os.replace(tmp, path)
        self._next_shard += 1
        self.paths.append(path)


def write_traces(traces: TraceSet, out_dir: str | os.PathLike, shard_size: int = 1024,
                 append: bool = False) -> list[Path]:
    """Write a TraceSet as shards into ``out_dir``; returns the shard paths.

    Refuses a directory that already holds shards unless ``append`` (see ``TraceWriter``)."""
    with TraceWriter(out_dir, traces.model, shard_size, append=append) as writer:
        writer.add_set(traces)
    return writer.paths


def _records_to_set(records: Sequence[TraceRecord], model: ModelSpec) -> TraceSet:
    kinds = sorted({k for r in records for k in r.labels})

    def gate(name: str) -> np.ndarray | None:
        values = [getattr(r, name) for r in records]
        if all(v is None for v in values):
            return None
        if any(v is None for v in values):
            raise ValueError(f"field '{name}' set on some records only")
        return np.stack(values).astype(np.float32)

    return TraceSet(
        model=model,
        request_ids=np.array([str(r.request_id) for r in records], dtype=str),
        prefill_counts=np.stack([r.prefill_counts for r in records]).astype(np.int32),
        decode_counts=np.stack([r.decode_counts for r in records]).astype(np.int32),
        prompt_tokens=np.array([r.prompt_tokens for r in records], dtype=np.int64),
        output_tokens=np.array([r.output_tokens for r in records], dtype=np.int64),
        labels={k: np.array([r.labels.get(k, "") for r in records], dtype=str) for k in kinds},
        gate_prob_sums=gate("gate_prob_sums"),
        gate_logit_sums=gate("gate_logit_sums"),
    )


def find_shards(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """Expand directories into their sorted ``shard-*.npz`` files."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    shards: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(q for q in p.glob("shard-*.npz") if SHARD_NAME.fullmatch(q.name))  # no .tmp.npz
            if not found:
                raise ValueError(f"{p}: no shard-*.npz files")
            shards.extend(found)
        elif p.is_file():
            shards.append(p)
        else:
            raise ValueError(f"{p}: no such trace file or directory")
    return shards


def read_shard(path: str | os.PathLike) -> TraceSet:
    """Read and validate one shard; errors name the file and the field."""
    path = Path(path)
    try:
        data = np.load(path, allow_pickle=False)
    except Exception as exc:  # zip/npy errors come in many types
        raise ValueError(f"{path}: not a readable npz shard ({exc})") from None
    with data:
        files = set(data.files)

        def need(name: str) -> np.ndarray:
            if name not in files:
                raise ValueError(f"{path}: missing field '{name}'")
            try:
                return data[name]
            except Exception as exc:
                raise ValueError(f"{path}: field '{name}' unreadable ({exc})") from None

        try:
            meta = json.loads(str(need("meta")))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: field 'meta' is not JSON ({exc})") from None
        model = ModelSpec.from_dict(meta, f"{path}: field 'meta'")
        ids = need("request_id")
        n = ids.shape[0] if ids.ndim == 1 else -1
        if ids.ndim != 1 or ids.dtype.kind != "U":
            raise ValueError(f"{path}: field 'request_id' must be a 1-D string array, got {ids.dtype} {ids.shape}")
        grid = (n, model.num_layers, model.num_experts)
        cols: dict[str, np.ndarray | None] = {}
        for name in COUNT_FIELDS:
            cols[name] = _check(path, name, need(name), grid, "iu").astype(np.int32, copy=False)
            if cols[name].size and cols[name].min() < 0:
                raise ValueError(f"{path}: field '{name}' has negative counts")
        for name in TOKEN_FIELDS:
            cols[name] = _check(path, name, need(name), (n,), "iu").astype(np.int64, copy=False)
        for name in GATE_FIELDS:
            cols[name] = _check(path, name, data[name], grid, "f").astype(np.float32, copy=False) if name in files else None
            if cols[name] is not None and not np.isfinite(cols[name]).all():
                raise ValueError(f"{path}: field '{name}' has non-finite values")
        labels = {}
        for name in sorted(f for f in files if f.startswith(LABEL_PREFIX)):
            labels[name[len(LABEL_PREFIX):]] = _check(path, name, data[name], (n,), "U")
    return TraceSet(
        model=model,
        request_ids=ids,
        prefill_counts=cols["prefill_counts"],
        decode_counts=cols["decode_counts"],
        prompt_tokens=cols["prompt_tokens"],
        output_tokens=cols["output_tokens"],
        labels=labels,
        gate_prob_sums=cols["gate_prob_sums"],
        gate_logit_sums=cols["gate_logit_sums"],
    )


def _check(path: Path, name: str, arr: np.ndarray, shape: tuple, kinds: str) -> np.ndarray:
    if arr.shape != shape:
        raise ValueError(f"{path}: field '{name}' has shape {arr.shape}, expected {shape}")
    if arr.dtype.kind not in kinds:
        raise ValueError(f"{path}: field '{name}' has dtype {arr.dtype}, expected kind '{kinds}'")
    return arr


def iter_traces(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> Iterator[TraceSet]:
    """Yield one validated TraceSet per shard (streaming; one shard in memory)."""
    for shard in find_shards(paths):
        yield read_shard(shard)


def load_traces(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> TraceSet:
    """Load all shards under ``paths`` (files or directories) into one TraceSet."""
    parts = []
    for shard in find_shards(paths):
        part = read_shard(shard)
        if parts and part.model != parts[0].model:
            raise ValueError(f"{shard}: field 'meta' model {part.model} differs from {parts[0].model}")
        parts.append(part)
    return parts[0] if len(parts) == 1 else concat_traces(parts)
