"""What identifies a configured backend (:func:`~mla_backends.backends.contract.configure_backend`): its
configuration's key, and the check of the ``(spec, scale)`` it is configured with."""

from __future__ import annotations

import itertools
from collections.abc import Hashable

from .capabilities import AttentionSpec

__all__ = ["ConfigurationKey", "check_configuration"]


class ConfigurationKey:
    """What a configured backend was configured for: ``(class, options, spec, scale)``, hashed once (every layer
    call looks its prepared state up by it). Equal keys share prepared states in a step plan."""

    __slots__ = ("parts", "_hash", "token")
    _tokens = itertools.count(1)

    def __init__(self, parts: tuple[Hashable, ...]) -> None:
        self.parts = parts
        self._hash = hash(parts)
        #: a small int naming this key object (the plan records accepted declarations under it)
        self.token = next(ConfigurationKey._tokens)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, ConfigurationKey) and self._hash == other._hash
                                 and self.parts == other.parts)

    def __repr__(self) -> str:
        cls, _options, spec, scale = self.parts
        return f"{getattr(cls, 'name', cls)} configured for {spec!r}, scale {scale!r}"


def check_configuration(spec: object, scale: object) -> float:
    """``scale`` as a float, once ``spec`` is an :class:`AttentionSpec` and ``scale`` a positive finite number;
    raises naming the argument otherwise (what :func:`configure_backend` accepts)."""
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"spec: got {type(spec).__name__}; supported AttentionSpec")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0 or scale == float("inf"):
        raise ValueError(f"scale: got {scale!r}; supported a positive finite float (the unabsorbed softmax scale)")
    return float(scale)
