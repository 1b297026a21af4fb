"""Readable tables and JSON documents for selections and selection failures."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from mla_backends.backends.contract import AttentionSpec
from mla_backends.backends.reasons import as_reason
from mla_backends.core.device import DeviceInfo
from mla_backends.core.dtypes import dtype_name
from mla_backends.core.errors import error_dict
from mla_backends.plugins.registry import PluginProblem

# this module formats what selector.select returns (Selection, SelectionError and their Verdicts) and is imported
# lazily by it; it reads those objects by their attributes, so it names their types only in docstrings (an import
# back would make the two modules a cycle)
Selection = SelectionError = Verdict = Any

__all__ = ["format_selection", "format_failure", "selection_dict", "failure_dict", "device_dict",
           "format_problems", "capability_summary", "capability_data"]


def _request_line(spec: AttentionSpec) -> str:
    kv = spec.kv_cache_dtype
    kv_text = f"{spec.resolved_kv_cache_dtype} (auto)" if kv == "auto" else kv
    page = "backend's preferred" if spec.block_size is None else str(spec.block_size)
    q = f"max query len {spec.max_query_len}" + ("" if spec.uniform_query_len else " (varying)")
    v4 = [w for w, on in (("sinks", spec.sinks), ("window", spec.window), ("compressed keys", spec.compressed)) if on]
    attention = f"DeepSeek-V4 ({', '.join(v4)})" if v4 else ("sparse" if spec.sparse else "dense")
    return (f"{spec.num_heads} heads, kv_lora_rank {spec.kv_lora_rank}, rope {spec.qk_rope_head_dim}, "
            f"dtype {dtype_name(spec.dtype)}, kv cache {kv_text}, page size {page}, "
            f"{attention}, {q}" + (", needs LSE" if spec.need_lse else ""))


def _device_line(device: DeviceInfo) -> str:
    mem = f", {device.total_memory / 2**30:.1f} GiB" if device.total_memory else ""  # nvidia-smi's total
    return device.describe() + mem


def _table(verdicts: Iterable[Verdict]) -> list[str]:
    rows = list(verdicts)
    width = max([len("backend")] + [len(v.name) for v in rows])
    src_w = max([len("source")] + [len(v.source) for v in rows])
    head = f"  {'#':>2}  {'backend':<{width}}  {'source':<{src_w}}  {'verdict':<8}  {'page':>4}  reasons"
    lines = [head]
    pad = " " * (len(head) - len("reasons"))
    for i, v in enumerate(rows, 1):
        verdict = "SELECTED" if v.selected else ("fits" if v.fits else "rejected")
        page = "-" if v.block_size is None else str(v.block_size)
        reasons = [str(r) for r in v.reasons] or (["-"] if v.selected else ["fits, lower priority"])
        lines.append(f"  {i:>2}  {v.name:<{width}}  {v.source:<{src_w}}  {verdict:<8}  {page:>4}  "
                     f"{reasons[0]}")
        lines += [pad + r for r in reasons[1:]]
    return lines


def _page_notes(verdicts: Iterable[Verdict], spec: AttentionSpec) -> list[str]:
    return [f"Note: {v.name} ranks higher and was rejected only because of block_size={spec.block_size}; "
            f"block_size={v.page_size_hint} would select it."
            for v in verdicts if v.page_size_hint is not None]


def format_problems(problems: Iterable[PluginProblem]) -> list[str]:
    """Plugin problems as lines (empty when there are none)."""
    problems = list(problems)
    if not problems:
        return []
    return ["Plugin problems (ignored; selection is unaffected):"] + [f"  - {p.describe()}" for p in problems]


def format_selection(sel: Selection) -> str:
    """Header (device, request, ladder), the verdict per candidate, the choice, page-size notes, plugin problems."""
    asked = replace(sel.spec, block_size=sel.requested_block_size)
    lines = [f"Device:  {_device_line(sel.device)}", f"Request: {_request_line(asked)}",
             f"Ladder:  {sel.ladder}"]
    lines += _table(sel.verdicts)
    why = "its preferred page size" if sel.requested_block_size is None else "as requested"
    how = ""
    if sel.forced_by:
        how = ("forced by the MLA_BACKEND environment variable; " if sel.forced_by == "MLA_BACKEND"
               else "forced by the backend argument; ")
    lines.append(f"Chosen: {sel.name}, block_size {sel.block_size} ({how}{why})")
    lines += _page_notes(sel.verdicts, asked)
    lines += [f"Note: {n}" for n in sel.notes]
    lines += format_problems(sel.plugin_problems)
    return "\n".join(lines)


def format_failure(device: DeviceInfo, spec: AttentionSpec, verdicts: tuple[Verdict, ...], ladder: str,
                   problems: Iterable[PluginProblem], footer: str) -> str:
    """The message of :class:`NoBackendError` / :class:`BackendNotSupportedError`."""
    lead = ("No MLA backend fits this request." if ladder != "forced"
            else f"The forced backend {verdicts[0].name} does not fit this request.")
    lines = [lead, f"Device:  {_device_line(device)}", f"Request: {_request_line(spec)}",
             f"Ladder:  {ladder}"]
    lines += _table(verdicts)
    lines += _page_notes(verdicts, spec)
    lines.append(footer)
    lines += format_problems(problems)
    return "\n".join(lines)


def device_dict(device: DeviceInfo) -> dict[str, Any]:
    cc = device.compute_capability
    return {"kind": device.kind, "name": device.name, "arch": device.arch_label,
            "compute_capability": None if cc is None else list(cc), "total_memory": device.total_memory,
            "index": device.index, "sm_count": device.sm_count, "simulated": device.simulated}


def _candidates(verdicts: Iterable[Verdict]) -> list[dict[str, Any]]:
    return [{"name": v.name, "source": v.source, "selected": v.selected, "fits": v.fits,
             "reasons": [str(r) for r in v.reasons], "reason_details": [as_reason(r).to_dict() for r in v.reasons],
             "block_size": v.block_size, "page_size_hint": v.page_size_hint}
            for v in verdicts]


def _request_dict(spec: AttentionSpec) -> dict[str, Any]:
    return {"num_heads": spec.num_heads, "kv_lora_rank": spec.kv_lora_rank,
            "qk_rope_head_dim": spec.qk_rope_head_dim, "dtype": dtype_name(spec.dtype),
            "kv_cache_dtype": spec.resolved_kv_cache_dtype, "block_size": spec.block_size,
            "sparse": spec.sparse,
            "max_query_len": spec.max_query_len, "uniform_query_len": spec.uniform_query_len,
            "need_lse": spec.need_lse, "sinks": spec.sinks, "window": spec.window, "compressed": spec.compressed}


def selection_dict(sel: Selection) -> dict[str, Any]:
    """``{"backend", "block_size", "device", "candidates", ...}`` (the ``--json`` format)."""
    return {"backend": sel.name, "source": next((v.source for v in sel.verdicts if v.selected), None),
            "block_size": sel.block_size, "requested_block_size": sel.requested_block_size,
            "device": device_dict(sel.device), "candidates": _candidates(sel.verdicts), "ladder": sel.ladder,
            "forced_by": sel.forced_by, "request": _request_dict(sel.spec), "notes": list(sel.notes),
            "plugin_problems": [p.describe() for p in sel.plugin_problems]}


def failure_dict(err: SelectionError) -> dict[str, Any]:
    """The ``--json`` document when nothing fits: ``backend`` and ``block_size`` are null."""
    return {"backend": None, "source": None, "block_size": None, "requested_block_size": err.spec.block_size,
            "device": device_dict(err.device), "candidates": _candidates(err.verdicts), "ladder": err.ladder,
            "forced_by": getattr(err, "forced_by", None), "request": _request_dict(err.spec),
            **error_dict(err, message=str(err).splitlines()[0], argument=_forced_argument(err)),
            "hint": getattr(err, "hint", None), "notes": list(err.notes),
            "plugin_problems": [p.describe() for p in err.plugin_problems]}


def _forced_argument(err: SelectionError) -> str | None:
    """The argument that forced a backend that does not fit (``backend`` or ``MLA_BACKEND``), else None."""
    forced_by = getattr(err, "forced_by", None)
    return {"argument": "backend", "MLA_BACKEND": "MLA_BACKEND"}.get(forced_by or "") if forced_by else None


def capability_summary(cls: type) -> dict[str, Any]:
    """The declarations of one backend as plain data (shared by ``list`` and ``docs/selection.md``)."""
    caps = cls.capabilities
    cc = caps.compute_capability_text()
    if caps.num_heads is not None:
        heads = ", ".join(map(str, sorted(caps.num_heads)))
    else:
        heads = "any" if caps.max_num_heads is None else f"<= {caps.max_num_heads}"
    return {
        "devices": ("CPU" if caps.cpu and caps.compute_capabilities == frozenset()
                    else f"CPU; CUDA {cc}" if caps.cpu else f"CUDA {cc}"),
        "dtypes": sorted(dtype_name(d) for d in caps.dtypes),
        "kv_cache_dtypes": sorted(caps.kv_cache_dtypes),
        "fp8_min_compute_capability": caps.fp8_min_compute_capability,
        "page_sizes": caps.supported_page_sizes_text(),
        "preferred_page_size": caps.preferred_page_size,
        "dims": "any" if caps.dims is None else ", ".join(f"{a}/{b}" for a, b in sorted(caps.dims)),
        "num_heads": heads,
        "query_len": caps.query_len.name.lower(),
        "decode_threshold": caps.decode_threshold,
        "attention": "/".join(k for k, on in (("dense", caps.dense), ("sparse", caps.sparse)) if on)
                     + (" + V4" if caps.sinks and caps.window and caps.compressed else ""),
        "returns_lse": caps.returns_lse,
        "requires": list(caps.requires),
        "extra": caps.extra,
    }


def _pairs(values: object) -> list[list[int]] | None:
    return None if values is None else [list(v) for v in sorted(values)]  # type: ignore[call-overload]


def capability_data(cls: type) -> dict[str, Any]:
    """The declarations of one backend as data (lists, ints, bools, None): ``mla-backends list --json``.

    Compute capabilities are ``[major, minor]`` pairs; ``page_sizes`` / ``num_heads`` / ``dims`` are None
    when any value is accepted (``page_size_multiple`` / ``max_num_heads`` then may bound them).
    """
    caps = cls.capabilities
    cc_bound = [None if c is None else list(c) for c in
                (caps.min_compute_capability, caps.max_compute_capability, caps.fp8_min_compute_capability)]
    return {
        "cpu": caps.cpu,
        "cpu_env_switch": caps.cpu_env_switch,
        "compute_capabilities": _pairs(caps.compute_capabilities),
        "min_compute_capability": cc_bound[0],
        "max_compute_capability": cc_bound[1],
        "fp8_min_compute_capability": cc_bound[2],
        "dtypes": sorted(dtype_name(d) for d in caps.dtypes),
        "kv_cache_dtypes": sorted(caps.kv_cache_dtypes),
        "page_sizes": None if caps.page_sizes is None else list(caps.page_sizes),
        "page_size_multiple": caps.page_size_multiple,
        "preferred_page_size": caps.preferred_page_size,
        "dims": _pairs(caps.dims),
        "num_heads": None if caps.num_heads is None else sorted(caps.num_heads),
        "max_num_heads": caps.max_num_heads,
        "query_len": caps.query_len.name.lower(),
        "decode_threshold": caps.decode_threshold,
        "dense": caps.dense,
        "sparse": caps.sparse,
        "sinks": caps.sinks,
        "window": caps.window,
        "compressed": caps.compressed,
        "returns_lse": caps.returns_lse,
        "deterministic": caps.deterministic,
        "requires": list(caps.requires),
        "extra": caps.extra,
    }
