"""The backend contract: ``MLABackend`` (``contract``), what a backend declares (``capabilities``:
``Capabilities``, ``AttentionSpec``), why it does not fit (``reasons``: ``Reason``, ``ReasonKind``), the shared
``forward_mqa`` input checks (``inputs``) and the naive expanded decode kept as a timing baseline (``naive``).
The implementations live beside this package: ``mla_backends.ref_torch``, ``mla_backends.triton_mla``,
``mla_backends.flashinfer_mla``.

Imports: ``core`` and ``step``; nothing above.
"""
