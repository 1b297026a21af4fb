"""The layer's view of dispatch: every name of :mod:`mla_backends.backends.dispatch`, where the policies and
``step_runs`` live since 0.5 (below the layer, so that ``plan_step(meta, [backend], dispatch=...)`` gives an engine
the runs a layer gets). Kept so that 0.4 imports (``from mla_backends.layer.dispatch import PerRequestPolicy``) and
the layer's own read as before."""

from __future__ import annotations

from ..backends.dispatch import (
    SGLANG_PREFIX_THRESHOLD,
    TABLE_FORMAT,
    THRESHOLD_TABLE_ENV,
    ContextThresholds,
    DispatchPolicy,
    PerBatchPolicy,
    PerRequestPolicy,
    ThresholdTable,
    clamp_to_backend,
    decode_threshold,
    layer_policy,
    policy_from_table,
    resolve_policy,
    runs_key,
    step_runs,
    table_from_env,
)

__all__ = ["DispatchPolicy", "PerRequestPolicy", "PerBatchPolicy", "ContextThresholds", "ThresholdTable",
           "TABLE_FORMAT", "THRESHOLD_TABLE_ENV", "SGLANG_PREFIX_THRESHOLD", "resolve_policy",
           "clamp_to_backend", "policy_from_table", "table_from_env", "layer_policy", "decode_threshold",
           "step_runs", "runs_key"]
