"""The threshold table's 0.4 home: every name of :mod:`mla_backends.backends.thresholds`, where the table lives
since 0.5 (beside dispatch, which owns it)."""

from __future__ import annotations

from ..backends.thresholds import TABLE_FORMAT, ContextThresholds, ThresholdTable, TunedThresholds

__all__ = ["TABLE_FORMAT", "ContextThresholds", "ThresholdTable", "TunedThresholds"]
