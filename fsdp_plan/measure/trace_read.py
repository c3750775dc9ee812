"""Read one ``torch.profiler`` trace (Chrome/Kineto JSON, ``.json`` or ``.json.gz``) into typed
events, streamed so a large trace costs its text plus a compact record per event.

A trace is what ``export_chrome_trace`` or ``tensorboard_trace_handler`` writes for one rank of
any training loop: ``traceEvents`` plus ``distributedInfo`` (rank, world size, backend) and
``deviceProperties``. Only complete (``ph: X``) events of the kinds the analysis reads are kept,
each as a ``TraceEvent`` with the few ``args`` it uses; flow events (``ac2g``) fill in the
correlation of kernels and launches that lack ``args.correlation``.

[Note: reading a large trace]
The stdlib ``json.load`` of a 200 MB trace builds a dict per event (about 2 GB of Python
objects). Here only the top-level object is walked by hand; each element of ``traceEvents`` is
decoded with ``JSONDecoder.raw_decode`` and turned into a ``TraceEvent`` (slots, interned
names) before the next is read, so the peak is the text and the kept records. Traces over
``MAX_TRACE_BYTES`` of JSON are refused before they are parsed.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any

from fsdp_plan.common.errors import BadInput

MAX_TRACE_BYTES = 2 << 30
"""2 GiB of trace JSON (decompressed): ten times the largest traces users share; a larger
file is refused rather than filling the machine's memory."""
KEPT_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver",
                             "cpu_op", "user_annotation", "gpu_user_annotation"})
_ARGS_FOR = ("gloo:", "c10d::", "nccl:", "record_param_comms")
"""Host events whose ``args`` (input dims and types, message sizes) the analysis reads."""
_intern = sys.intern
_ARGS_KEPT = ("stream", "Collective name", "In msg nelems", "Out msg nelems",
              "dtype", "Group size", "Input Dims", "Input type", "Process Group Name")
_SPACE = re.compile(r"[\s,]*")
_BOUNDARY = re.compile(r"\}[ \t]*,[ \t]*\r?\n\s*\{")
"""Between two events as Kineto writes them (``},`` then a new line): never inside a string,
where JSON allows no raw new line."""
_CHUNK_CHARS = 4 << 20

_fast_loads = json.loads
"""The decoder of each event's JSON (the standard library's: no dependency to read traces)."""


@dataclass(slots=True)
class TraceEvent:
    """One complete event: times in microseconds as the profiler writes them."""

    name: str
    cat: str
    ts: float
    dur: float
    pid: Any
    tid: Any
    correlation: int | None = None
    args: dict[str, Any] | None = None

    @property
    def end(self) -> float:
        return self.ts + self.dur

    @property
    def is_device(self) -> bool:
        """Work that ran on the GPU (a kernel, a copy or a memset)."""
        return self.cat in ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(kw_only=True)
class RawTrace:
    """The kept events of one file and what it says about its rank."""

    path: str
    events: list[TraceEvent]
    rank: int | None = None
    world_size: int | None = None
    backend: str | None = None
    device: str | None = None
    thread_names: dict[Any, str] = field(default_factory=dict)


def _text(path: str, limit: int) -> str:
    """The file's JSON text, gunzipped when it is gzip; refused past ``limit`` bytes."""
    try:
        with open(path, "rb") as f:
            magic = f.read(2)
        opener = gzip.open if magic == b"\x1f\x8b" else open
        with opener(path, "rb") as f:
            data = f.read(limit + 1)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise BadInput(f"trace {path!r} is a damaged gzip file ({e}); it was probably cut off "
                       "while being written or copied. Record or copy it again.") from e
    if len(data) > limit:
        raise BadInput(f"trace {path!r} holds more than {limit / 2**30:.1f} GiB of JSON; "
                       "profile fewer steps (torch.profiler.schedule(active=...)) or split "
                       "the run into shorter traces.")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(f"trace {path!r} is not a profiler trace: it is neither JSON text nor "
                       "gzip-compressed JSON. Give the .json or .json.gz file that "
                       "export_chrome_trace or tensorboard_trace_handler wrote.") from e


def _not_json(path: str, error: Exception) -> BadInput:
    return BadInput(f"trace {path!r} is not valid JSON ({error}); a trace cut off while being "
                    "written reads like this. Give a complete export_chrome_trace / "
                    "tensorboard_trace_handler file.")


def _walk_events(text: str, start: int, path: str, out: list[Any], keep) -> int:
    """Decode the array at ``text[start]`` into ``out`` (via ``keep``), a chunk of elements at
    a time; returns the position after the array. See [Note: reading a large trace]."""
    pos = _SPACE.match(text, start + 1).end()
    reach = _CHUNK_CHARS
    while True:
        boundary = _BOUNDARY.search(text, pos + reach)
        if boundary is not None:
            try:
                items = _fast_loads("[" + text[pos:boundary.start() + 1] + "]")
            except ValueError:  # the chunk runs past the array's end or splits an element
                items = None
            if items is not None:
                for item in items:
                    keep(item, out)
                del items
                pos, reach = boundary.end() - 1, _CHUNK_CHARS
                continue
        if reach > 4096:  # near the array's end: shorter chunks before element by element
            reach //= 8
            continue
        until = boundary.start() + 1 if boundary is not None else len(text)
        pos, ended = _walk_slowly(text, pos, path, out, keep, until)
        if ended:
            return pos
        reach = _CHUNK_CHARS


def _walk_slowly(text: str, pos: int, path: str, out: list[Any], keep,
                 until: int) -> tuple[int, bool]:
    """Decode elements from ``pos`` one by one with ``raw_decode`` until one ends at or past
    ``until`` or the array ends; returns the next position and whether the array ended."""
    decoder = json.JSONDecoder()
    while pos < len(text) and text[pos] != "]":
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise _not_json(path, e) from e
        keep(item, out)
        pos = _SPACE.match(text, pos).end()
        if pos >= until and pos < len(text) and text[pos] != "]":
            return pos, False
    if pos >= len(text):
        raise _not_json(path, ValueError("the traceEvents list never ends"))
    return pos + 1, True


def parse_trace_text(text: str, path: str = "<trace>") -> tuple[dict[str, Any], list[Any]]:
    """(top-level fields other than ``traceEvents``, kept raw items) of a trace's text."""
    decoder = json.JSONDecoder()
    kept: list[Any] = []
    pos = _SPACE.match(text, 0).end()
    if text.startswith("[", pos):  # Chrome's array form: the events alone
        _walk_events(text, pos, path, kept, _keep)
        return {}, kept
    if not text.startswith("{", pos):
        raise BadInput(f"trace {path!r} is not a profiler trace: its JSON is not an object "
                       "with a traceEvents list.")
    meta: dict[str, Any] = {}
    found = False
    pos = _SPACE.match(text, pos + 1).end()
    while pos < len(text) and text[pos] != "}":
        try:
            key, pos = decoder.raw_decode(text, pos)
            pos = re.compile(r"\s*:\s*").match(text, pos).end()
            if key == "traceEvents" and text.startswith("[", pos):
                pos, found = _walk_events(text, pos, path, kept, _keep), True
            else:
                meta[str(key)], pos = decoder.raw_decode(text, pos)
        except (json.JSONDecodeError, AttributeError) as e:
            raise _not_json(path, e) from e
        pos = _SPACE.match(text, pos).end()
    if pos >= len(text):
        raise _not_json(path, ValueError("the top-level object never ends"))
    if not found:
        raise BadInput(f"trace {path!r} is JSON but has no traceEvents list: it is not a "
                       "torch.profiler trace (export_chrome_trace / tensorboard_trace_handler).")
    return meta, kept


def _keep(item: Any, out: list[Any]) -> None:
    """Keep complete events of ``KEPT_CATEGORIES``, flow ends and thread names, compactly:
    ``args`` only where the analysis reads more than the correlation (kernels, collectives)."""
    if item.__class__ is not dict:
        return
    ph = item.get("ph")
    if ph == "X":
        cat = item.get("cat") or ""
        if cat not in KEPT_CATEGORIES:
            return
        try:
            ts, dur = float(item["ts"]), float(item.get("dur", 0.0))
        except (KeyError, TypeError, ValueError):
            return
        args = item.get("args")
        if args.__class__ is not dict:
            args = {}
        corr = args.get("correlation")
        name = str(item.get("name", ""))
        kept = None
        if args and (cat == "kernel" or name.startswith(_ARGS_FOR)):
            kept = {k: args[k] for k in _ARGS_KEPT if k in args} or None
        out.append(TraceEvent(_intern(name), _intern(cat), ts, dur if dur > 0 else 0.0,
                              item.get("pid"), item.get("tid"),
                              corr if corr.__class__ is int else None, kept))
    elif ph in ("s", "f") and item.get("cat") == "ac2g":
        out.append((ph, item.get("id"), item.get("pid"), item.get("tid"), item.get("ts")))
    elif ph == "M" and item.get("name") == "thread_name":
        out.append(("M", (item.get("pid"), item.get("tid")),
                    str((item.get("args") or {}).get("name", ""))))


def _device_name(meta: dict[str, Any]) -> str | None:
    props = meta.get("deviceProperties")
    if isinstance(props, list) and props and isinstance(props[0], dict):
        return str(props[0].get("name")) if props[0].get("name") else None
    return None


def read_trace(path: str, *, limit: int | None = None) -> RawTrace:
    """The kept events of the trace file at ``path``, with its rank, world size and device;
    more than ``limit`` bytes of JSON (default ``MAX_TRACE_BYTES``) is refused."""
    limit = MAX_TRACE_BYTES if limit is None else limit
    if not os.path.isfile(path):
        raise BadInput(f"trace {path!r} does not exist or is not a file.")
    text = _text(path, limit)
    meta, kept = parse_trace_text(text, path)
    del text
    return _raw(path, meta, kept)


def _raw(path: str, meta: dict[str, Any], kept: list[Any]) -> RawTrace:
    events = [k for k in kept if isinstance(k, TraceEvent)]
    flows = [k for k in kept if isinstance(k, tuple) and k[0] in ("s", "f")]
    names = {k[1]: k[2] for k in kept if isinstance(k, tuple) and k[0] == "M"}
    _fill_correlation_from_flows(events, flows)
    info = meta.get("distributedInfo") if isinstance(meta.get("distributedInfo"), dict) else {}

    def as_int(value: Any) -> int | None:
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    return RawTrace(path=path, events=events, rank=as_int(info.get("rank")),
                    world_size=as_int(info.get("world_size")), backend=info.get("backend"),
                    device=_device_name(meta), thread_names=names)


def raw_from_dict(trace: dict[str, Any] | list[Any], path: str = "<trace>") -> RawTrace:
    """A trace already decoded (``json.load`` of a file) as ``read_trace`` would read it."""
    items = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    kept: list[Any] = []
    for item in items if isinstance(items, list) else []:
        _keep(item, kept)
    return _raw(path, trace if isinstance(trace, dict) else {}, kept)


def _fill_correlation_from_flows(events: list[TraceEvent], flows: list[tuple]) -> None:
    """Give kernels and launches without ``args.correlation`` the id of the ``ac2g`` flow that
    starts (``s``, at the launch) or ends (``f``, at the kernel) where they do."""
    if not flows:
        return
    at = {(pid, tid, ts): fid for _, fid, pid, tid, ts in flows if isinstance(fid, int)}
    for e in events:
        if e.correlation is None:
            fid = at.get((e.pid, e.tid, e.ts))
            e.correlation = fid
