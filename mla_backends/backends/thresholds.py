"""The threshold table: the one JSON file format of measured decode thresholds (owned by dispatch).

``mla-backends tune --output FILE`` writes it and every reader takes it: ``MLAAttention(threshold_table=FILE)``,
``MLA_BACKENDS_THRESHOLD_TABLE=FILE``, :meth:`mla_backends.backends.dispatch.PerRequestPolicy.from_table` and
:func:`mla_backends.backends.dispatch.policy_from_table`::

    {"format": "mla-backends/threshold-table/v1", "date": "...", "device": {...}, "versions": {...},
     "model": {...}, "grid": {"query_lens": [...], "contexts": [...]},
     "backends": {"REF_TORCH": {"entries": [{"max_context": 512, "threshold": 40}, ...],
                                "crossovers": [...], "timings": [...]}}}

In memory: a :class:`ThresholdTable` maps each measured backend to its :class:`ContextThresholds` (the
``entries``: a decode threshold per context-length bucket) and keeps everything else (provenance, raw
timings) verbatim in ``info``.
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.config_fields import load_json_file
from ..core.validation import require_int

__all__ = ["TABLE_FORMAT", "ContextThresholds", "ThresholdTable", "TunedThresholds"]

#: the ``format`` value of every threshold table
TABLE_FORMAT = "mla-backends/threshold-table/v1"


@dataclass(frozen=True)
class ContextThresholds:
    """One backend's measured decode thresholds by context length (a table's ``entries``).

    ``entries`` are ``(max_context, threshold)`` pairs sorted by ``max_context``: a request whose cached
    context is ``<= max_context`` of the first matching entry uses that entry's threshold; beyond the last
    entry the last threshold applies. A threshold of 0 sends every multi-token request of that bucket to MHA
    (single tokens still decode).
    """

    entries: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.entries, tuple) or not self.entries:
            raise ValueError(f"entries: got {self.entries!r}; supported a non-empty tuple of "
                             "(max_context, threshold) pairs")
        prev = -1
        for i, pair in enumerate(self.entries):
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise TypeError(f"entries[{i}]: got {pair!r}; supported a (max_context, threshold) pair")
            mc, th = pair
            require_int(f"entries[{i}].max_context", mc, minimum=0)
            require_int(f"entries[{i}].threshold", th, minimum=0)
            if mc <= prev:
                raise ValueError(f"entries[{i}].max_context: got {mc} after {prev}; "
                                 "supported increasing values")
            prev = mc

    def threshold(self, context_len: int) -> int:
        """The decode threshold for a request with ``context_len`` cached tokens."""
        keys = [mc for mc, _ in self.entries]
        i = min(bisect.bisect_left(keys, context_len), len(keys) - 1)
        return self.entries[i][1]

    @classmethod
    def from_entries(cls, entries: Any, *, where: str = "entries") -> ContextThresholds:
        """From the JSON list ``[{"max_context": int, "threshold": int}, ...]`` (any order)."""
        if isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence) or not entries:
            raise ValueError(f"{where}: got {entries!r}; supported a non-empty list of "
                             "{'max_context': int, 'threshold': int}")
        pairs = []
        for i, e in enumerate(entries):
            if not isinstance(e, Mapping) or "max_context" not in e or "threshold" not in e:
                raise ValueError(f"{where}[{i}]: got {e!r}; supported {{'max_context': int, 'threshold': int}}")
            pairs.append((e["max_context"], e["threshold"]))
        return cls(tuple(sorted(pairs)))

    def to_entries(self) -> list[dict[str, int]]:
        """The JSON list :meth:`from_entries` reads."""
        return [{"max_context": mc, "threshold": th} for mc, th in self.entries]


@dataclass(frozen=True)
class ThresholdTable:
    """Measured decode thresholds per backend, with where and when they were measured (the file above).

    ``backends`` maps a backend name (upper case) to its :class:`ContextThresholds`; ``info`` holds the
    provenance (device, versions, date, model, grid) and the raw measurements, kept verbatim in the JSON.
    """

    backends: Mapping[str, ContextThresholds]
    info: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.backends, Mapping):
            raise TypeError(f"backends: got {type(self.backends).__name__}; supported a mapping of backend name "
                            "-> ContextThresholds ((max_context, threshold) pairs are ContextThresholds)")
        if not self.backends:
            raise ValueError("backends: got none; supported at least one backend's thresholds")
        for name, t in self.backends.items():
            if not isinstance(t, ContextThresholds):
                raise TypeError(f"backends[{name!r}]: got {type(t).__name__}; supported ContextThresholds")
        if not isinstance(self.info, Mapping):
            raise TypeError(f"info: got {type(self.info).__name__}; supported a mapping")

    @property
    def backend_names(self) -> tuple[str, ...]:
        return tuple(sorted(self.backends))

    def for_backend(self, backend_name: str) -> ContextThresholds | None:
        """The backend's per-context thresholds, or None when this table has no measurement for it."""
        return self.backends.get(str(backend_name).strip().upper())

    def threshold_for(self, backend_name: str, context_len: int) -> int:
        """Largest query length run absorbed for a request with ``context_len`` cached tokens."""
        if isinstance(context_len, bool) or not isinstance(context_len, int) or context_len < 0:
            raise ValueError(f"context_len: got {context_len!r}; supported an int >= 0")
        t = self.for_backend(backend_name)
        if t is None:
            raise ValueError(f"backend_name: got {backend_name!r}; supported {', '.join(self.backend_names)} "
                             f"(the backends this table measured)")
        return t.threshold(context_len)

    # ---- JSON --------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": TABLE_FORMAT}
        out.update({k: v for k, v in self.info.items() if k not in ("format", "backends")})
        results = self.info.get("backends", {})
        out["backends"] = {}
        for name in self.backend_names:
            entry = dict(results.get(name, {}))
            entry["entries"] = self.backends[name].to_entries()
            out["backends"][name] = entry
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ThresholdTable:
        """From the JSON object :meth:`to_dict` gives (what ``mla-backends tune --output`` writes)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"table: got {type(data).__name__}; supported a JSON object")
        if data.get("format") != TABLE_FORMAT:
            raise ValueError(f"table.format: got {data.get('format')!r}; supported {TABLE_FORMAT!r} "
                             "(the file 'mla-backends tune --output' writes)")
        raw = data.get("backends")
        if not isinstance(raw, Mapping) or not raw:
            raise ValueError("table.backends: got none; supported {name: {'entries': [...]}, ...}")
        backends = {}
        for k, v in raw.items():
            if not isinstance(v, Mapping):
                raise ValueError(f"table.backends[{k!r}]: got {v!r}; supported {{'entries': [...], ...}}")
            backends[str(k).upper()] = ContextThresholds.from_entries(v.get("entries"),
                                                                      where=f"table.backends[{k!r}].entries")
        info = {k: v for k, v in data.items() if k != "format"}
        info["backends"] = {str(k).upper(): {kk: vv for kk, vv in v.items() if kk != "entries"}
                            for k, v in raw.items()}
        return cls(backends, info)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, argument: str = "threshold_table") -> ThresholdTable:
        """Read a table written by ``mla-backends tune --output``; errors name ``argument`` (where the path
        came from: the argument, or the environment variable) and the path."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"{argument}: got {type(path).__name__}; supported a path to a threshold table")
        p = os.fspath(path)
        if not os.path.isfile(p):
            raise ValueError(f"{argument}: got {p!r}, which is not a file; supported a JSON file written "
                             f"by 'mla-backends tune --output'")
        try:
            data = load_json_file(p)
        except ValueError as exc:  # unreadable, not UTF-8, not JSON, nested too deeply
            raise ValueError(f"{argument}: got {p!r}, not valid JSON ({exc}); supported a table "
                             f"written by 'mla-backends tune --output'") from None
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{argument}: got {p!r}: {exc}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=2)
            fh.write("\n")


#: the name ``mla_backends.planning.tuning`` used for :class:`ThresholdTable` (kept for existing callers)
TunedThresholds = ThresholdTable
