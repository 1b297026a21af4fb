"""Building and loading CPU_FUSED's compiled kernel (``csrc/mla_decode.cpp``): once per machine, cached, never
at import.

The library is compiled with this machine's C++ compiler for this CPU's instruction set (``-march=native``:
AVX2 + FMA, AVX-512 where present) against the running torch, into a per-machine cache folder whose name is a
hash of everything the binary depends on: the source, the torch version, the Python ABI, the CPU's feature
flags and the compiler flags (:func:`build_key`). So a cache shared between machines (an NFS home) or
between environments never serves a library built for another CPU or another torch; the environments that
share torch and Python (``.venv``, ``.venv-vllm``, ``.venv-sglang`` here) share one build.

What builds it: ``mla-backends build`` (``make install`` runs it), or the first ``forward_mqa`` of a
``CpuFusedBackend`` used explicitly. :func:`build_status` and :func:`is_built` only look at files: the
selector calls them and never builds. Concurrent builds (pytest-xdist workers, engine processes) take a file
lock, and the library is written under a temporary name and renamed into place, so a reader never sees half a
file.

The cache folder: ``$MLA_BACKENDS_CACHE_DIR``, else ``$XDG_CACHE_HOME/mla-backends``, else
``~/.cache/mla-backends``; the library lives in ``<cache>/cpu_fused/<key>/``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SOURCE", "CACHE_DIR_ENV", "CXX_ENV", "ARCH_ENV", "LIBRARY_NAME", "OP_NAMESPACE", "BuildError",
           "BuildStatus", "cache_root", "cpu_flags", "build_key", "library_path", "compiler", "build_status",
           "is_built", "build", "load", "decode_op", "compile_command"]

#: the kernel's source, shipped with the package
SOURCE = Path(__file__).resolve().parent / "csrc" / "mla_decode.cpp"
#: where built libraries are cached (overrides the XDG / home default)
CACHE_DIR_ENV = "MLA_BACKENDS_CACHE_DIR"
#: the C++ compiler to use (default: ``c++``, then ``g++``, then ``clang++`` on the PATH)
CXX_ENV = "CXX"
#: the instruction set to compile for (``-march=``; default ``native``: this CPU); part of the cache key
ARCH_ENV = "MLA_BACKENDS_CPU_ARCH"
LIBRARY_NAME = "libmla_cpu_fused.so"
#: the torch.ops namespace the library registers (``torch.ops.mla_backends_cpu_fused.decode``)
OP_NAMESPACE = "mla_backends_cpu_fused"
#: flags every build uses besides the include paths and the target (changing them changes the key)
_FLAGS = ("-O3", "-std=c++20", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=fast")
#: how long a build may take before it is abandoned (seconds)
BUILD_TIMEOUT_S = 900


class BuildError(RuntimeError):
    """The kernel could not be built (no compiler, a compiler error, an unwritable cache folder); the message
    says what and how to fix it."""


def cache_root() -> Path:
    """The cache folder (:data:`CACHE_DIR_ENV`, ``$XDG_CACHE_HOME/mla-backends`` or ``~/.cache/mla-backends``)."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "mla-backends"


@functools.cache
def cpu_flags() -> tuple[str, ...]:
    """This CPU's feature flags (Linux ``/proc/cpuinfo``: x86 ``flags``, Arm ``Features``), sorted; elsewhere
    the machine and processor names. Read once per process."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return tuple(sorted(set(value.split())))
    except OSError:
        pass
    return (platform.machine(), platform.processor())


def _target_flags() -> tuple[str, ...]:
    """The instruction-set flag: the compiler's own view of this CPU (``-march=native``), or the target
    :data:`ARCH_ENV` names (``x86-64-v3`` for a build that runs on every AVX2 machine of a cluster;
    ``x86-64-v2`` for the portable SSE code path)."""
    target = os.environ.get(ARCH_ENV, "").strip() or "native"
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return (f"-mcpu={target}",)
    return (f"-march={target}",)


@functools.cache
def _torch_facts() -> tuple[str, bool]:
    """``(torch version, whether torch was built with the C++11 ABI)``: torch is imported here, not at import of
    this module."""
    import torch

    return torch.__version__, bool(torch._C._GLIBCXX_USE_CXX11_ABI)


@functools.cache
def _source_digest() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()


def build_key() -> str:
    """The cache key of a library for this process (:func:`_build_key` of the target in effect)."""
    return _build_key(_target_flags())


@functools.cache
def _build_key(target: tuple[str, ...]) -> str:
    """The cache key of a library for this process: a hash of the source, torch's version and ABI, the Python
    ABI, the machine, the CPU's flags and the compiler flags (16 hex digits)."""
    version, cxx11 = _torch_facts()
    parts = [_source_digest(), version, str(cxx11), sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag,
             platform.machine(), " ".join(cpu_flags()), " ".join(_FLAGS + target)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def library_path() -> Path:
    """Where this process's library is (or would be) cached."""
    return cache_root() / "cpu_fused" / build_key() / LIBRARY_NAME


def compiler() -> str | None:
    """The C++ compiler a build would use (:data:`CXX_ENV`, else ``c++``, ``g++`` or ``clang++`` on the
    PATH), or None when there is none."""
    env = os.environ.get(CXX_ENV)
    if env:
        return shutil.which(env) or (env if os.path.isfile(env) else None)
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    return None


@dataclass(frozen=True)
class BuildStatus:
    """Whether the kernel is usable here, from files only (nothing is built or loaded).

    Attributes:
        built: the library for this process's key exists.
        path: where it is (or would be).
        compiler: the compiler a build would use, or None.
        missing: what stops a build (empty when a build could run), each with how to add it.
        build_seconds: how long the cached build took, when it recorded it.
    """

    built: bool
    path: Path
    compiler: str | None
    missing: tuple[str, ...]
    build_seconds: float | None = None


def build_status() -> BuildStatus:
    """:class:`BuildStatus` of this process (file checks and a PATH lookup; fast enough for every selection)."""
    path = library_path()
    cxx = compiler()
    missing = () if cxx else ("a C++ compiler (apt install g++, or set CXX)",)
    seconds = None
    if path.is_file():
        try:
            seconds = json.loads(path.with_name("build.json").read_text()).get("seconds")
        except (OSError, ValueError):
            seconds = None
    return BuildStatus(built=path.is_file(), path=path, compiler=cxx, missing=missing, build_seconds=seconds)


#: cache folders (by the variables that choose them) where this process found its library: checked once
_FOUND: set[tuple[str | None, ...]] = set()


def is_built() -> bool:
    """True when this process's library is in the cache: one file check, then remembered for that cache folder
    (the selector asks this for every uncached selection, and a bare instance's call for every call)."""
    where = (os.environ.get(CACHE_DIR_ENV), os.environ.get("XDG_CACHE_HOME"), os.environ.get("HOME"),
             os.environ.get(ARCH_ENV))
    if where in _FOUND:
        return True
    if library_path().is_file():
        _FOUND.add(where)
        return True
    return False


def compile_command(cxx: str, output: Path) -> list[str]:
    """The compiler's command line for a library at ``output`` (torch's headers and libraries, this CPU)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    _, cxx11 = _torch_facts()
    cmd = [cxx, *_FLAGS, *_target_flags(), f"-D_GLIBCXX_USE_CXX11_ABI={int(cxx11)}"]
    for inc in include_paths():
        cmd += ["-isystem", inc]
    cmd += [str(SOURCE), "-o", str(output)]
    for lib in library_paths():
        cmd += ["-L", lib]
    cmd += ["-lc10", "-ltorch_cpu"]
    return cmd


class _FileLock:
    """An exclusive lock on ``path`` across processes (``fcntl.flock``; a no-op where there is no fcntl: the
    atomic rename still keeps the cache whole, two processes may then both compile)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fh = None

    def __enter__(self) -> _FileLock:
        try:
            import fcntl
        except ImportError:
            return self
        self.fh = open(self.path, "a+")  # noqa: SIM115 - held until __exit__
        fcntl.flock(self.fh, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fh is not None:
            import fcntl

            fcntl.flock(self.fh, fcntl.LOCK_UN)
            self.fh.close()


def build(*, force: bool = False, verbose: bool = False) -> Path:
    """Compile the kernel into the cache unless it is there (``force``: rebuild), and return its path.

    Safe to call from many processes at once: one compiles, the others wait on the lock and find the result.

    Raises:
        BuildError: no compiler, an unwritable cache folder, or the compiler failed (its output is kept in the
            message, the last 4,000 characters).
    """
    path = library_path()
    if path.is_file() and not force:
        return path
    cxx = compiler()
    if cxx is None:
        raise BuildError("CPU_FUSED: no C++ compiler found (looked for $CXX, c++, g++, clang++); install one "
                         "(apt install g++) and run `mla-backends build`")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BuildError(f"CPU_FUSED: cannot create the cache folder {path.parent} ({exc}); set "
                         f"{CACHE_DIR_ENV} to a writable folder") from exc
    with _FileLock(path.parent / "build.lock"):
        if path.is_file() and not force:  # another process built it while this one waited
            return path
        fd, tmp_name = tempfile.mkstemp(prefix=".building-", suffix=".so", dir=path.parent)
        os.close(fd)
        tmp = Path(tmp_name)
        cmd = compile_command(cxx, tmp)
        if verbose:
            print(" ".join(cmd), flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            tmp.unlink(missing_ok=True)
            raise BuildError(f"CPU_FUSED: the compiler {cxx} could not run ({exc})") from exc
        seconds = time.perf_counter() - t0
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            log = (proc.stdout + proc.stderr)[-4000:]
            raise BuildError(f"CPU_FUSED: the build failed ({cxx}, exit {proc.returncode}):\n{log}")
        os.replace(tmp, path)
        record = {"seconds": round(seconds, 1), "compiler": cxx, "command": cmd, "key": build_key(),
                  "torch": _torch_facts()[0], "python": sys.version.split()[0], "built_at": time.time()}
        path.with_name("build.json").write_text(json.dumps(record, indent=1) + "\n")
    return path


_LOAD_LOCK = threading.Lock()
_LOADED: dict[str, str] = {}
_OPS: dict[str, object] = {}


def load(*, build_if_missing: bool = True) -> str:
    """Load the library into this process (once) and return its build info
    (``"vector_width=8;isa=avx2,fma,f16c"``); builds it first when it is missing and ``build_if_missing``.

    Raises:
        BuildError: not built (and ``build_if_missing`` is False), or the build failed.
    """
    info = _LOADED.get("info")
    if info is not None:  # the hot path: loaded already
        return info
    with _LOAD_LOCK:
        if "info" in _LOADED:
            return _LOADED["info"]
        import torch

        path = library_path()
        if not path.is_file():
            if not build_if_missing:
                raise BuildError("CPU_FUSED: the kernel is not built for this machine; run `mla-backends build`")
            path = build()
        torch.ops.load_library(str(path))
        ops = getattr(torch.ops, OP_NAMESPACE)
        info = str(ops.build_info())
        _OPS["decode"] = ops.decode.default
        _LOADED["info"] = info
        return info


def decode_op() -> object:
    """The kernel's ``torch.ops`` handle (``decode.default``: no overload resolution per call), loading the
    library first (building it when missing)."""
    op = _OPS.get("decode")
    if op is None:
        load()
        op = _OPS["decode"]
    return op
