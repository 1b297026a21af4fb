"""The test module ``mla-backends conformance NAME`` runs: the suite on ``--conformance-backend``.

It only makes sense with the plugin loaded (the CLI passes ``-p mla_backends.testing.plugin``).
"""

from __future__ import annotations

from mla_backends.testing.suite import BackendConformance


class TestConformance(BackendConformance):
    """Backend, matrix and device come from the ``--conformance-*`` options of the plugin."""
