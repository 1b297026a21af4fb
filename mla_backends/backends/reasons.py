"""Why a backend does not fit a request, as data: :class:`Reason` and its :class:`ReasonKind`.

Every capability check (the base class's declared checks and a backend's own
:meth:`~mla_backends.backends.contract.MLABackend.backend_reasons`) returns ``Reason`` values. Code that needs to treat
some reasons differently (the layer and ``forward_mqa`` ignore missing packages, the selector's hint looks for
"only a package is missing", ``forward_mqa`` raises ``TypeError`` when only dtypes are wrong) filters on
:attr:`Reason.kind`, never on the wording. ``str(reason)`` is the sentence users read:
``"<what>: got <got>; supported <supported>"`` (plus ``"; <hint>"`` when a hint is given).

A reason compares equal to its text, so code that compared reason strings keeps working; third-party
backends may still return plain strings from their hook: :func:`as_reason` wraps them as kind ``OTHER``.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..core.errors import USER_CODE_FAILURES, failure_text, plugin_call

__all__ = ["ReasonKind", "Reason", "as_reason", "reason_texts", "without_kinds", "all_of_kinds", "returned_reasons",
           "reasons_of"]


class ReasonKind(enum.StrEnum):
    """What a reason is about (its category; the selector, the layer and the suite filter on it)."""

    PACKAGE = "package"  # a required module is not installed
    VERSION = "version"  # the installed package is outside the tested range or lacks an entry point
    DEVICE = "device"  # CPU vs CUDA, compute capability
    DTYPE = "dtype"  # the query / model dtype
    KV_CACHE_DTYPE = "kv_cache_dtype"  # the cache's storage dtype (or an unknown cache dtype name)
    FP8 = "fp8"  # an extra rule for fp8 caches (device generation, query dtype)
    PAGE_SIZE = "page_size"
    DIMS = "dims"  # kv_lora_rank / qk_rope_head_dim
    NUM_HEADS = "num_heads"
    QUERY_LEN = "query_len"  # query tokens per request
    ATTENTION = "attention"  # dense vs sparse
    LSE = "lse"  # the caller wants an LSE the backend does not return
    REGISTRY = "registry"  # the name is not registered
    CHECK_FAILED = "check_failed"  # the backend's own check raised
    OTHER = "other"  # anything else, including plain strings from third-party hooks


@dataclass(frozen=True, eq=False)
class Reason:
    """One reason a request does not fit a backend.

    Fields: ``kind`` (what it is about), ``what`` (the thing checked, e.g. ``"page size"``), ``got`` (the
    request's value, as text), ``supported`` (what the backend accepts, as text), ``hint`` (an optional
    remedy appended after ``"; "``). ``text``, when set, is the exact sentence for a reason that does not read
    "got X; supported Y" (say, a wrapped third-party string); ``got``/``supported`` may then be None.

    Equality and hashing follow :meth:`__str__`, and a reason equals the ``str`` of the same text.
    """

    kind: ReasonKind
    what: str
    got: str | None = None
    supported: str | None = None
    hint: str | None = None
    text: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ReasonKind):
            raise TypeError(f"kind: got {self.kind!r}; supported a ReasonKind")
        if not isinstance(self.what, str) or not self.what:
            raise ValueError(f"what: got {self.what!r}; supported a non-empty str")
        if self.text is None and (self.got is None or self.supported is None):
            raise ValueError("got/supported: got None; supported both set, or the exact sentence in text=")

    def __str__(self) -> str:
        if self.text is not None:
            return self.text
        tail = f"; {self.hint}" if self.hint else ""
        return f"{self.what}: got {self.got}; supported {self.supported}{tail}"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Reason):
            return self.kind == other.kind and str(self) == str(other)
        if isinstance(other, str):
            return str(self) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(str(self))

    def with_hint(self, hint: str) -> Reason:
        """The same reason with ``hint`` appended (after any hint it already has)."""
        if self.text is not None:
            return Reason(self.kind, self.what, self.got, self.supported, self.hint, f"{self.text}; {hint}")
        return Reason(self.kind, self.what, self.got, self.supported,
                      f"{self.hint}; {hint}" if self.hint else hint)

    def to_dict(self) -> dict[str, Any]:
        """``{"text", "kind", "what", "got", "supported", "hint"}`` (the ``select --json`` form)."""
        return {"text": str(self), "kind": self.kind.value, "what": self.what, "got": self.got,
                "supported": self.supported, "hint": self.hint}


def as_reason(value: Reason | str, kind: ReasonKind = ReasonKind.OTHER) -> Reason:
    """``value`` itself when it is a :class:`Reason`; a plain string becomes a reason of ``kind`` (``OTHER``
    by default) whose text is the string and whose ``what`` is the part before the first ``":"``."""
    if isinstance(value, Reason):
        return value
    if not isinstance(value, str) or not value.strip():
        raise TypeError(f"reason: got {value!r}; supported a Reason or a non-empty str")
    what = value.split(":", 1)[0].strip() or value
    return Reason(kind, what, text=value)


def reason_texts(reasons: Iterable[Reason | str]) -> list[str]:
    """The sentences of ``reasons``, in order."""
    return [str(r) for r in reasons]


def without_kinds(reasons: Iterable[Reason | str], *kinds: ReasonKind) -> list[Reason]:
    """``reasons`` (wrapped by :func:`as_reason`) less those whose kind is one of ``kinds``."""
    return [r for r in map(as_reason, reasons) if r.kind not in kinds]


def all_of_kinds(reasons: Iterable[Reason | str], *kinds: ReasonKind) -> bool:
    """True when there is at least one reason and every one has a kind among ``kinds``."""
    wrapped = [as_reason(r) for r in reasons]
    return bool(wrapped) and all(r.kind in kinds for r in wrapped)


def returned_reasons(returned: object, hook: str = "backend_reasons") -> list[Reason]:
    """What a backend's ``hook`` returned, as :class:`Reason` values: any iterable (a list, a tuple, a generator)
    of reasons or non-empty strings. A string, a coroutine (an ``async def`` hook, closed here unawaited), None
    or another non-iterable raises ``TypeError`` naming the hook and what is supported."""
    if inspect.iscoroutine(returned):
        returned.close()
        raise TypeError(f"{hook}: returned a coroutine (an async def method), which never ran; supported a plain "
                        "def returning a list of Reason values (empty when the request fits)")
    if isinstance(returned, (str, bytes)) or not isinstance(returned, Iterable):
        raise TypeError(f"{hook}: returned {type(returned).__name__}; supported a list of Reason values (or "
                        "non-empty str), empty when the request fits")
    return [as_reason(r) for r in returned]


def reasons_of(cls: Any, spec: Any) -> list[Reason]:
    """``cls.not_supported_reasons(spec)`` as :class:`Reason` values, asked safely: the one way the selector, the
    layer, ``forward_mqa``'s declaration check and ``tune`` ask a backend (a plugin's class included) whether a
    request fits. A check that raises anything but Ctrl-C (an exception, ``sys.exit()``, a wrong return) gives
    one reason of kind ``CHECK_FAILED`` naming what it raised; the caller's process and selection go on."""
    try:
        with plugin_call(cls, "not_supported_reasons()"):
            return returned_reasons(cls.not_supported_reasons(spec), "not_supported_reasons")
    except USER_CODE_FAILURES as exc:
        return [Reason(ReasonKind.CHECK_FAILED, "capability check", failure_text(exc),
                       "a check that returns reasons")]
