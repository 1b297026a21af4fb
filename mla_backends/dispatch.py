"""Which requests of a step take the absorbed (MQA) path and which take the expanded (MHA) path.

Two policies, both selectable on :class:`~mla_backends.layer.MLAAttention`:

- :class:`PerRequestPolicy` (vLLM's rule): a request whose query length is ``<=`` a decode threshold is a
  "decode" and runs absorbed; longer ones run ``forward_mha``. The threshold is the backend's declared
  ``capabilities.decode_threshold`` unless the policy fixes one, or a :class:`ThresholdTable` gives one per
  context length (a measured crossover table).
- :class:`PerBatchPolicy` (SGLang's rule): one decision for the whole step. A batch of single-token
  decodes runs absorbed. A batch with any longer request runs expanded when the summed cached prefix of its
  requests is 0 (a cold prefill) or ``>= prefix_threshold`` (8192 by default, SGLang's
  ``chunked_prefix_cache_threshold``), and absorbed otherwise. A threshold of 0 makes every extend batch
  expanded; it never forces absorption.

Either way the choice is then clamped by what the backend's ``forward_mqa`` accepts: requests longer than a
single-token backend takes always run expanded.
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .backend import QueryLenSupport
from .validation import require_int

__all__ = ["DispatchPolicy", "PerRequestPolicy", "PerBatchPolicy", "ThresholdTable", "resolve_policy",
           "SGLANG_PREFIX_THRESHOLD"]

#: SGLang's default ``chunked_prefix_cache_threshold`` (tokens of summed cached prefix)
SGLANG_PREFIX_THRESHOLD = 8192


@runtime_checkable
class DispatchPolicy(Protocol):
    """Decides, per request, whether the absorbed path runs it."""

    name: str

    def absorbed(self, query_lens: Sequence[int], context_lens: Sequence[int], *,
                 backend_threshold: int) -> list[bool]:
        """One flag per request (same order as the inputs): True = absorbed ``forward_mqa``, False = MHA."""
        ...


@dataclass(frozen=True)
class ThresholdTable:
    """Measured decode thresholds by context length.

    ``entries`` are ``(max_context, threshold)`` pairs sorted by ``max_context``: a request whose cached
    context is ``<= max_context`` of the first matching entry uses that entry's threshold; beyond the last
    entry the last threshold applies. A threshold of 0 sends every multi-token request of that bucket to MHA
    (single tokens still decode).

    JSON form (what :meth:`from_json` reads)::

        {"entries": [{"max_context": 1024, "threshold": 4}, {"max_context": 65536, "threshold": 64}]}
    """

    entries: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not self.entries:
            raise ValueError("entries: got none; supported at least one (max_context, threshold) pair")
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
    def from_dict(cls, data: Mapping[str, Any]) -> ThresholdTable:
        if not isinstance(data, Mapping) or not isinstance(data.get("entries"), Sequence):
            raise ValueError("table: got no 'entries' list; supported {'entries': [{'max_context': int, "
                             "'threshold': int}, ...]}")
        pairs = []
        for i, e in enumerate(data["entries"]):
            if not isinstance(e, Mapping) or "max_context" not in e or "threshold" not in e:
                raise ValueError(f"table entries[{i}]: got {e!r}; "
                                 "supported {'max_context': int, 'threshold': int}")
            pairs.append((e["max_context"], e["threshold"]))
        return cls(tuple(sorted(pairs)))

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> ThresholdTable:
        with open(path, encoding="utf-8") as fh:
            return cls.from_dict(json.load(fh))

    def to_dict(self) -> dict[str, Any]:
        return {"entries": [{"max_context": mc, "threshold": th} for mc, th in self.entries]}


@dataclass(frozen=True)
class PerRequestPolicy:
    """vLLM-style split by query length. ``threshold`` None: the backend's ``decode_threshold``."""

    threshold: int | None = None
    table: ThresholdTable | None = None
    name: str = "per-request"

    def __post_init__(self) -> None:
        if self.threshold is not None:
            require_int("threshold", self.threshold, minimum=0)
        if self.threshold is not None and self.table is not None:
            raise ValueError("threshold/table: got both; supported one of them (or neither)")
        if self.table is not None and not isinstance(self.table, ThresholdTable):
            raise TypeError(f"table: got {type(self.table).__name__}; supported ThresholdTable")

    @classmethod
    def from_table(cls, path: str | os.PathLike[str]) -> PerRequestPolicy:
        """A policy reading its thresholds from a JSON :class:`ThresholdTable`."""
        return cls(table=ThresholdTable.from_json(path))

    def absorbed(self, query_lens: Sequence[int], context_lens: Sequence[int], *,
                 backend_threshold: int) -> list[bool]:
        out = []
        for q, c in zip(query_lens, context_lens, strict=True):
            if self.table is not None:
                th = max(1, self.table.threshold(c))
            else:
                th = backend_threshold if self.threshold is None else self.threshold
            out.append(q <= th)
        return out


@dataclass(frozen=True)
class PerBatchPolicy:
    """SGLang-style whole-batch decision on the summed cached prefix (see the module docstring)."""

    prefix_threshold: int = SGLANG_PREFIX_THRESHOLD
    name: str = "per-batch"

    def __post_init__(self) -> None:
        require_int("prefix_threshold", self.prefix_threshold, minimum=0)

    def absorbed(self, query_lens: Sequence[int], context_lens: Sequence[int], *,
                 backend_threshold: int) -> list[bool]:
        if all(q <= 1 for q in query_lens):  # a decode batch
            return [True] * len(query_lens)
        prefix = sum(c for q, c in zip(query_lens, context_lens, strict=True) if q > 0)
        expanded = prefix == 0 or prefix >= self.prefix_threshold
        return [not expanded] * len(query_lens)


def resolve_policy(policy: DispatchPolicy | str | None) -> DispatchPolicy:
    """``None``/``"per-request"``/``"vllm"`` -> :class:`PerRequestPolicy`; ``"per-batch"``/``"sglang"`` ->
    :class:`PerBatchPolicy`; a policy object is returned as is."""
    if policy is None:
        return PerRequestPolicy()
    if isinstance(policy, str):
        key = policy.strip().lower().replace("_", "-")
        if key in ("per-request", "vllm", "request"):
            return PerRequestPolicy()
        if key in ("per-batch", "sglang", "batch"):
            return PerBatchPolicy()
        raise ValueError(f"dispatch: got {policy!r}; supported 'per-request' (vllm), 'per-batch' (sglang) "
                         f"or a DispatchPolicy object")
    if isinstance(policy, DispatchPolicy):
        return policy
    raise TypeError(f"dispatch: got {type(policy).__name__}; supported a str or a DispatchPolicy object")


def clamp_to_backend(flags: list[bool], query_lens: Sequence[int], support: QueryLenSupport) -> list[bool]:
    """Send requests the backend's ``forward_mqa`` cannot take to MHA (single-token backends take ``q <= 1``).

    Zero-length requests produce no rows either way: they take their predecessor's flag so they never split a
    run of requests in two.
    """
    out: list[bool] = []
    for f, q in zip(flags, query_lens, strict=True):
        if q == 0:
            out.append(out[-1] if out else True)
        elif support == QueryLenSupport.SINGLE and q > 1:
            out.append(False)
        else:
            out.append(f)
    return out
