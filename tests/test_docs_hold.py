"""The docs promise things the code can check: every module is on the architecture page's module map, and
the integration page lists what it refuses and how to avoid thread oversubscription."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mla_backends"


def _section(path: Path, heading: str) -> str:
    text = path.read_text()
    start = text.index(heading)
    nxt = re.search(r"^## ", text[start + len(heading):], flags=re.M)
    return text[start : start + len(heading) + (nxt.start() if nxt else len(text))]


#: sub-packages whose modules the map describes as one row (the backend implementations, the suite, the CLI,
#: the engine adapters, V3.2's sparse layer, V4's layer)
_WHOLE = ("ref_torch/", "cpu_fused/", "triton_mla/", "flashinfer_mla/", "testing/", "cli/", "integrations/",
          "layer/sparse/", "layer/v4/")


def _modules() -> list[str]:
    """Every module of the package (``core/dims.py``) by path, a sub-package of :data:`_WHOLE` as a whole."""
    out = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if path.name in ("__init__.py", "__main__.py") and "/" not in rel:
            continue
        whole = next((w for w in _WHOLE if rel.startswith(w)), None)
        if whole:
            out.add(whole)
        elif path.name != "__init__.py":
            out.add(rel)
    return sorted(out)


def test_every_module_is_on_the_module_map() -> None:
    table = _section(ROOT / "docs" / "architecture.md", "## Module map")
    named = set(re.findall(r"`mla_backends/([\w/]+(?:\.py|/))`", table))
    missing = [m for m in _modules() if m not in named]
    assert not missing, f"docs/architecture.md's module map leaves out: {missing}"


def test_module_map_names_no_module_that_does_not_exist() -> None:
    table = _section(ROOT / "docs" / "architecture.md", "## Module map")
    for name in re.findall(r"`mla_backends/([\w/]+(?:\.py|/))`", table):
        assert (PACKAGE / name).exists(), f"docs/architecture.md names mla_backends/{name}, which does not exist"


def test_integration_page_names_every_refused_generate_option() -> None:
    from mla_backends.integrations.transformers import options as integration

    section = _section(ROOT / "docs" / "integrations.md", "## `mla_backends.integrations.transformers`")
    refused = [name for name, _, _ in integration.GENERATE_OPTIONS]
    assert "use_cache" in refused
    missing = [name for name in refused if f"`{name}" not in section]
    assert not missing, f"docs/integrations.md's refused options leave out {missing}"


def test_integration_page_says_how_to_avoid_thread_oversubscription() -> None:
    section = _section(ROOT / "docs" / "integrations.md", "## `mla_backends.integrations.transformers`")
    assert "OMP_WAIT_POLICY=PASSIVE" in section and "torch.set_num_threads" in section
