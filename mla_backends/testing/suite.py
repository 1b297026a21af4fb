"""``BackendConformance``: subclass it in a test module and pytest runs the whole suite on your backend.

    from mla_backends.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        backend = "MY_BACKEND"        # a registered name, "package.module:Class", or the class itself
        quick = False                 # optional: True for the reduced matrix (default: --conformance-quick)
        device = "auto"               # optional: "auto" | "cpu" | "cuda" (default: --conformance-device)
        seeds = 50                    # optional: random cases drawn inside the declarations (--conformance-seeds)
        seed = 0                      # optional: the first seed (--conformance-seed; default a fixed one)

The class parametrises its own tests (a class-level ``pytest_generate_tests``), so it works without the
plugin; the opt-in plugin (``-p mla_backends.testing.plugin``) only adds command-line options.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from ..backends.contract import MLABackend
from . import checks, context_split
from .cases import Case, DeclaredProbe, Matrix, UnsupportedProbe
from .matrix import build_matrix
from .v4_cases import V4_CASES, V4Case, run_v4_case

__all__ = ["BackendConformance", "resolve_backend"]


def resolve_backend(backend: Any) -> type[MLABackend]:
    """A backend class from a registered name (or vLLM's / SGLang's name for it), a ``"module:Class"``
    import path (registered or not), or the class itself; name resolution is
    :meth:`mla_backends.plugins.registry.Registry.resolve`."""
    if isinstance(backend, type) and issubclass(backend, MLABackend):
        return backend
    if backend is None:
        raise ValueError(
            "backend: got None; supported a registered backend name, 'module:Class' or an "
            "MLABackend subclass (set `backend = ...` on the class or pass --conformance-backend)"
        )
    from ..plugins.loading import get_backend

    return get_backend(backend)


class BackendConformance:
    """The conformance suite as a pytest test class (not collected itself: no ``Test`` prefix).

    Tests (each parametrised over cases generated from the backend's declared capabilities):

    - ``test_output_matches_reference``: output and natural-log LSE against the float64 expanded reference;
    - ``test_out_rows_outside_batch_untouched``: guard rows around ``out=``/``lse_out=`` slices stay intact;
    - ``test_inputs_not_written``: the cache, queries, top-k lists and metadata are only read;
    - ``test_deterministic``: two runs on the same inputs agree bitwise (unless declared non-deterministic);
    - ``test_declared_values_accepted`` / ``test_undeclared_combinations_rejected``: honest declarations;
    - ``test_rejects_bad_inputs``: mismatched arguments raise ``ValueError``/``TypeError``;
    - ``test_context_split_merge``: decode outputs and LSEs over interleaved shares of each sequence (decode
      context parallelism's layout, a share of a short request holding no row) merge by LSE to the reference;
    - ``test_no_host_sync``: backends declaring ``host_sync_free`` run dense calls under
      :func:`mla_backends.testing.no_host_sync` (skipped for the others and for sparse cases, whose top-k
      window check reads device values);
    - ``test_v4_case``: the DeepSeek-V4 cases (sliding windows, compressed entries, sinks, fp8 records) against
      their own float64 reference, judged like the others; skipped with the reasons where the backend does not
      declare V4's inputs.
    """

    backend: ClassVar[str | type[MLABackend] | None] = None
    quick: ClassVar[bool | None] = None
    device: ClassVar[str | None] = None
    seeds: ClassVar[int | None] = None
    seed: ClassVar[int | None] = None

    # ---- configuration ---------------------------------------------------------------------------------
    @classmethod
    def _settings(cls, config: pytest.Config) -> tuple[type[MLABackend], bool, str]:
        """The backend as judged where it runs (:func:`~mla_backends.testing.checks.judged_class`), the matrix
        size and the device preference."""
        backend = cls.backend if cls.backend is not None else config.getoption("conformance_backend", None)
        quick = cls.quick if cls.quick is not None else bool(config.getoption("conformance_quick", False))
        device = cls.device or config.getoption("conformance_device", None) or "auto"
        resolved = resolve_backend(backend)
        return checks.judged_class(resolved, checks.pick_device(resolved, device)), quick, device

    @classmethod
    def _seeds(cls, config: pytest.Config) -> tuple[int | None, int | None]:
        seeds = cls.seeds if cls.seeds is not None else config.getoption("conformance_seeds", None)
        seed = cls.seed if cls.seed is not None else config.getoption("conformance_seed", None)
        return seeds, seed

    @classmethod
    def conformance_matrix(cls, config: pytest.Config) -> Matrix:
        backend, quick, _ = cls._settings(config)
        return build_matrix(backend, quick, *cls._seeds(config))

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        matrix = self.conformance_matrix(metafunc.config)
        params: dict[str, tuple[Case, ...] | tuple[DeclaredProbe, ...] | tuple[UnsupportedProbe, ...]] = {
            "output_case": matrix.output,
            "guard_case": matrix.guard,
            "repeat_case": matrix.determinism,
            "declared_probe": matrix.declared,
            "unsupported_probe": matrix.unsupported,
            "v4_case": V4_CASES,
        }
        for name, values in params.items():
            if name in metafunc.fixturenames:
                metafunc.parametrize(name, values, ids=[getattr(v, "id", None) or f"v4-{v.name}" for v in values])

    @pytest.fixture
    def conformance_backend(self, request: pytest.FixtureRequest) -> type[MLABackend]:
        return self._settings(request.config)[0]

    @pytest.fixture
    def conformance_device(
        self, request: pytest.FixtureRequest, conformance_backend: type[MLABackend]
    ) -> torch.device:
        return checks.pick_device(conformance_backend, self._settings(request.config)[2])

    @staticmethod
    def _require_runnable(cls: type[MLABackend], case: Case, device: torch.device) -> None:
        reasons = checks.run_reasons(cls, case, device)
        if reasons:
            pytest.skip(f"{cls.name} cannot run {case.id} on {device}: {'; '.join(map(str, reasons))}")

    # ---- numerics ------------------------------------------------------------------------------------------
    def test_output_matches_reference(
        self, conformance_backend: type[MLABackend], conformance_device: torch.device, output_case: Case
    ) -> None:
        self._require_runnable(conformance_backend, output_case, conformance_device)
        checks.check_output(conformance_backend, output_case, conformance_device)

    # ---- guard bands ---------------------------------------------------------------------------------------
    def test_out_rows_outside_batch_untouched(
        self, conformance_backend: type[MLABackend], conformance_device: torch.device, guard_case: Case
    ) -> None:
        self._require_runnable(conformance_backend, guard_case, conformance_device)
        checks.check_out_rows_untouched(conformance_backend, guard_case, conformance_device)

    def test_inputs_not_written(
        self, conformance_backend: type[MLABackend], conformance_device: torch.device, guard_case: Case
    ) -> None:
        self._require_runnable(conformance_backend, guard_case, conformance_device)
        checks.check_inputs_not_written(conformance_backend, guard_case, conformance_device)

    # ---- determinism ---------------------------------------------------------------------------------------
    def test_deterministic(
        self, conformance_backend: type[MLABackend], conformance_device: torch.device, repeat_case: Case
    ) -> None:
        self._require_runnable(conformance_backend, repeat_case, conformance_device)
        checks.check_deterministic(conformance_backend, repeat_case, conformance_device)

    # ---- decode context parallelism: partials over shares of the cache merge by LSE ------------------------
    def test_context_split_merge(
        self, conformance_backend: type[MLABackend], conformance_device: torch.device, guard_case: Case
    ) -> None:
        why = context_split.context_split_skip_reason(conformance_backend, guard_case)
        if why:
            pytest.skip(why)
        self._require_runnable(conformance_backend, guard_case, conformance_device)
        context_split.check_context_split(conformance_backend, guard_case, conformance_device)

    # ---- no host sync --------------------------------------------------------------------------------------
    def test_no_host_sync(
        self, conformance_backend: type[MLABackend], conformance_device: torch.device, guard_case: Case
    ) -> None:
        if not conformance_backend.capabilities.host_sync_free:
            pytest.skip(f"{conformance_backend.name} declares host_sync_free=False")
        if guard_case.topk is not None:
            pytest.skip("sparse: the shared top-k window check reads device values (one sync per call)")
        self._require_runnable(conformance_backend, guard_case, conformance_device)
        checks.check_no_host_sync(conformance_backend, guard_case, conformance_device)

    # ---- honest declarations -------------------------------------------------------------------------------
    def test_declared_values_accepted(
        self, conformance_backend: type[MLABackend], declared_probe: DeclaredProbe
    ) -> None:
        checks.check_declared_accepted(
            conformance_backend, declared_probe.axis, declared_probe.value, declared_probe.case
        )

    def test_undeclared_combinations_rejected(
        self, conformance_backend: type[MLABackend], unsupported_probe: UnsupportedProbe
    ) -> None:
        checks.check_unsupported_rejected(conformance_backend, unsupported_probe)

    # ---- DeepSeek V4 ---------------------------------------------------------------------------------------
    def test_v4_case(self, conformance_backend: type[MLABackend], conformance_device: torch.device,
                     v4_case: V4Case) -> None:
        """One DeepSeek-V4 case (:mod:`~mla_backends.testing.v4_cases`: windows, compressed entries, sinks,
        records, NaN in every unowned slot) against its own float64 reference; skipped, with the backend's
        reasons, where it does not declare the case's inputs."""
        if conformance_device.type == "cuda" and not torch.cuda.is_available():
            pytest.skip(f"{conformance_backend.name} cannot run V4 case {v4_case.name} on cuda: device: got no CUDA "
                        "device (torch.cuda.is_available() is False); supported a CUDA device")
        result = run_v4_case(conformance_backend, v4_case, conformance_device)
        if result.status == "skipped":
            pytest.skip(f"{conformance_backend.name} does not declare V4 case {v4_case.name}: {result.detail}")
        assert result.status == "passed", f"V4 case {v4_case.name}: {result.detail}"

    # ---- input validation ----------------------------------------------------------------------------------
    def test_rejects_bad_inputs(
        self,
        request: pytest.FixtureRequest,
        conformance_backend: type[MLABackend],
        conformance_device: torch.device,
    ) -> None:
        case = self.conformance_matrix(request.config).guard[0]
        self._require_runnable(conformance_backend, case, conformance_device)
        checks.check_rejects_bad_inputs(conformance_backend, case, conformance_device)
