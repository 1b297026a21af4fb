"""Dispatch: which requests of a step take the absorbed (MQA) path and which the expanded (MHA) path.

Everything about that decision lives here, below the layer: ``MLAAttention`` asks it for its runs, and an engine
that calls a backend itself gets the same runs from ``plan_step(meta, [backend], dispatch=...)``
(:meth:`~mla_backends.backends.contract.MLABackend.plan_request`). (``mla_backends.layer.dispatch``, its home in
0.4, re-exports every name.)

- :class:`PerRequestPolicy` (vLLM's rule): a request whose query length is ``<=`` a decode threshold is a
  "decode" and runs absorbed; longer ones run ``forward_mha``. The threshold is the backend's declared
  ``capabilities.decode_threshold`` unless the policy fixes one, or a measured threshold table gives one per
  context length (:mod:`mla_backends.backends.thresholds`: the file ``mla-backends tune`` writes).
- :class:`PerBatchPolicy` (SGLang's rule): one decision for the whole step. A batch of single-token
  decodes runs absorbed. A batch with any longer request runs expanded when the summed cached prefix of its
  requests is 0 (a cold prefill) or ``>= prefix_threshold`` (8192 by default, SGLang's
  ``chunked_prefix_cache_threshold``), and absorbed otherwise. A threshold of 0 makes every extend batch
  expanded; it never forces absorption.
- :func:`layer_policy`: the policy a new layer uses, from its ``dispatch=`` and ``threshold_table=`` arguments
  and ``MLA_BACKENDS_THRESHOLD_TABLE``.
- :func:`step_runs`: a step cut into :class:`~mla_backends.step.plan.Run` s of consecutive requests on one
  path, after :func:`clamp_to_backend` (requests longer than a single-token backend takes run expanded; a
  uniform-length backend gets runs of equal query length). Kept in the step plan, so every layer with the
  same policy and backend reuses one computation.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..core.validation import require_int
from ..step.plan import Run
from .capabilities import Capabilities, QueryLenSupport
from .thresholds import TABLE_FORMAT, ContextThresholds, ThresholdTable

if TYPE_CHECKING:
    from ..step.metadata import BatchMetadata

__all__ = ["DispatchPolicy", "PerRequestPolicy", "PerBatchPolicy", "ContextThresholds", "ThresholdTable",
           "TABLE_FORMAT", "THRESHOLD_TABLE_ENV", "SGLANG_PREFIX_THRESHOLD", "resolve_policy",
           "clamp_to_backend", "policy_from_table", "table_from_env", "layer_policy", "decode_threshold",
           "step_runs", "runs_key"]

log = logging.getLogger(__name__)

#: SGLang's default ``chunked_prefix_cache_threshold`` (tokens of summed cached prefix)
SGLANG_PREFIX_THRESHOLD = 8192
#: environment variable naming a threshold table every new layer without ``dispatch=`` loads
THRESHOLD_TABLE_ENV = "MLA_BACKENDS_THRESHOLD_TABLE"


@runtime_checkable
class DispatchPolicy(Protocol):
    """Decides, per request, whether the absorbed path runs it."""

    name: str

    def absorbed(self, query_lens: Sequence[int], context_lens: Sequence[int], *,
                 backend_threshold: int) -> list[bool]:
        """One flag per request (same order as the inputs): True = absorbed ``forward_mqa``, False = MHA."""
        ...


@dataclass(frozen=True)
class PerRequestPolicy:
    """vLLM-style split by query length.

    ``threshold`` None and ``thresholds`` None: the backend's ``decode_threshold``. ``thresholds``: one
    backend's measured :class:`ContextThresholds` (from a threshold table; :meth:`from_table`).
    """

    threshold: int | None = None
    thresholds: ContextThresholds | None = None
    name: str = "per-request"

    def __post_init__(self) -> None:
        if self.threshold is not None:
            require_int("threshold", self.threshold, minimum=0)
        if self.threshold is not None and self.thresholds is not None:
            raise ValueError("threshold/thresholds: got both; supported one of them (or neither)")
        if self.thresholds is not None and not isinstance(self.thresholds, ContextThresholds):
            raise TypeError(f"thresholds: got {type(self.thresholds).__name__}; supported ContextThresholds")

    @classmethod
    def from_table(cls, table: ThresholdTable | str | os.PathLike[str],
                   backend_name: str | None = None) -> PerRequestPolicy:
        """The policy for ``backend_name`` under a threshold table (a path to the file ``mla-backends tune``
        writes, or a :class:`ThresholdTable`). ``backend_name`` may be left out when the table measured one
        backend only."""
        if not isinstance(table, ThresholdTable):
            table = ThresholdTable.load(table, argument="table")
        if backend_name is None:
            if len(table.backends) != 1:
                raise ValueError(f"backend_name: got None for a table measuring {', '.join(table.backend_names)}; "
                                 "supported one of them")
            (backend_name,) = table.backend_names
        policy = policy_from_table(table, backend_name, strict=True)
        assert policy is not None  # strict
        return policy

    def absorbed(self, query_lens: Sequence[int], context_lens: Sequence[int], *,
                 backend_threshold: int) -> list[bool]:
        out = []
        for q, c in zip(query_lens, context_lens, strict=True):
            if self.thresholds is not None:
                th = max(1, self.thresholds.threshold(c))
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



def policy_from_table(table: ThresholdTable | str | os.PathLike[str], backend_name: str, *, strict: bool = True,
                      argument: str = "threshold_table") -> PerRequestPolicy | None:
    """The per-request policy a layer running ``backend_name`` uses under ``table`` (a table or a path).

    When the table has no measurement for the backend: ``strict`` raises ValueError naming the measured
    backends; otherwise a warning is logged and None returned (the backend's constant then applies). Errors
    and the warning name ``argument`` (where the table came from).
    """
    if not isinstance(table, ThresholdTable):
        if not isinstance(table, (str, os.PathLike)):
            raise TypeError(f"{argument}: got {type(table).__name__}; supported a path or a ThresholdTable")
        table = ThresholdTable.load(table, argument=argument)
    ctx = table.for_backend(backend_name)
    if ctx is None:
        msg = (f"{argument}: has no measurement for backend {backend_name!r}; supported "
               f"{', '.join(table.backend_names)}")
        if strict:
            raise ValueError(msg)
        log.warning("%s; using the backend's own decode threshold", msg)
        return None
    return PerRequestPolicy(thresholds=ctx)


def table_from_env() -> str | None:
    """The path in ``MLA_BACKENDS_THRESHOLD_TABLE``, or None when unset or empty."""
    value = os.environ.get(THRESHOLD_TABLE_ENV, "").strip()
    return value or None


def layer_policy(dispatch: DispatchPolicy | str | None, threshold_table: ThresholdTable | str | os.PathLike[str]
                 | None, backend_name: str) -> DispatchPolicy:
    """The policy a new layer running ``backend_name`` uses (``MLAAttention`` calls it once, when built).

    - ``threshold_table`` given: it must hold ``backend_name``'s measurement (else ValueError), and
      ``dispatch`` must be None (both given: ValueError).
    - otherwise, when ``dispatch`` is None and ``MLA_BACKENDS_THRESHOLD_TABLE`` names a file, that table is
      used if it measured this backend (a warning is logged and the backend's constant kept if not); a
      missing or malformed file raises ValueError naming the variable.
    - otherwise :func:`resolve_policy` of ``dispatch``.
    """
    if threshold_table is not None:
        if dispatch is not None:
            raise ValueError("threshold_table/dispatch: got both; supported one of them (a table implies the "
                             "per-request policy)")
        policy = policy_from_table(threshold_table, backend_name, strict=True)
        assert policy is not None  # strict
        return policy
    env = table_from_env()
    if env is not None and dispatch is None:
        policy = policy_from_table(env, backend_name, strict=False, argument=THRESHOLD_TABLE_ENV)
        if policy is not None:
            return policy
    return resolve_policy(dispatch)


def decode_threshold(policy: DispatchPolicy, capabilities: Capabilities) -> int:
    """Largest query length run absorbed under ``policy`` on a backend declaring ``capabilities``: a
    per-request policy's fixed threshold (0: nothing absorbed), at most 1 on single-token backends; otherwise
    the backend's own ``decode_threshold``. Build the step's metadata with it and the split is one cut."""
    if isinstance(policy, PerRequestPolicy) and policy.threshold is not None:
        if capabilities.query_len == QueryLenSupport.SINGLE:
            return min(1, policy.threshold)
        return policy.threshold
    return capabilities.decode_threshold


def step_runs(meta: BatchMetadata, policy: DispatchPolicy, capabilities: Capabilities, *,
              sparse: bool = False) -> tuple[Run, ...]:
    """The step's processing-order requests cut into runs ``Run(absorbed, start, stop)``.

    Each request's path is ``policy``'s choice clamped to the backend (:func:`clamp_to_backend`); sparse steps
    (DeepSeek-V3.2 top-k) run every request absorbed. Consecutive requests on one path form a run, except that
    a uniform-length backend gets a new run wherever the query length changes. A pure function of host data:
    :func:`~mla_backends.step.plan.plan_step` calls it once per step and dispatch key
    (:func:`runs_key`), and the layers read the result from the plan.
    """
    if not isinstance(capabilities, Capabilities):
        raise TypeError(f"capabilities: got {type(capabilities).__name__}; supported Capabilities")
    if not isinstance(policy, DispatchPolicy):
        raise TypeError(f"policy: got {type(policy).__name__}; supported a DispatchPolicy")
    q, c = meta.query_lens_list, meta.context_lens_list
    if sparse:
        flags = [True] * len(q)
    else:
        wanted = policy.absorbed(q, c, backend_threshold=capabilities.decode_threshold)
        flags = clamp_to_backend(list(wanted), list(q), capabilities.query_len)
    runs: list[Run] = []
    for b, f in enumerate(flags):
        split_uniform = (f and capabilities.query_len == QueryLenSupport.UNIFORM and runs and q[b] != 0
                         and q[runs[-1].start] != q[b])
        if runs and runs[-1].absorbed == f and not split_uniform:
            runs[-1] = Run(f, runs[-1].start, b + 1)
        else:
            runs.append(Run(f, b, b + 1))
    return tuple(runs)


def runs_key(policy: DispatchPolicy, capabilities: Capabilities, *, sparse: bool = False) -> Hashable:
    """The key a step plan keeps :func:`step_runs`' result under: layers with the same policy, the same
    query-length declarations and the same sparsity share their runs. A policy that cannot be hashed is
    keyed by its identity."""
    key: Hashable = (policy, capabilities.query_len, capabilities.decode_threshold, bool(sparse))
    try:
        hash(key)
    except TypeError:
        key = (id(policy), capabilities.query_len, capabilities.decode_threshold, bool(sparse))
    return key
