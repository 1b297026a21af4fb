"""Issue 28 items 9 and 11: device arguments and argument types.

Classes: (1) every public entry point that takes a device checks it with the one device check
(``validation.require_device``): a bogus string, a CUDA index past the last GPU (or CUDA on a machine without
it), a non-ASCII digit (``"sm9²"``) or a float is a ValueError / TypeError naming ``device``, never torch's
RuntimeError or AssertionError; (2) declared types are enforced: every ``Capabilities`` field (each boolean
included), the alias helpers' names and a DCP layer's ``dcp_group``.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest
import torch

from mla_backends.backends.capabilities import Capabilities
from mla_backends.core.device import parse_device_spec
from mla_backends.core.dims import MLADims
from mla_backends.layer.attention import MLAAttention
from mla_backends.layer.dcp import dcp_group_for
from mla_backends.layer.sparse.indexer import hadamard_matrix
from mla_backends.layer.sparse.indexer_cache import IndexerKeyCache
from mla_backends.layer.sparse.layer_support import build_indexer
from mla_backends.layer.workspace import shared_workspace, shared_workspaces, workspace_key
from mla_backends.planning.tuning import check_grid_fits, tunable_backends
from mla_backends.plugins import aliases
from mla_backends.step.cache import LatentKVCache
from mla_backends.step.graph import DecodeGraphMetadata
from mla_backends.step.metadata import BatchMetadata
from selector.select import select_backend

ROOT = pathlib.Path(__file__).resolve().parent.parent
DIMS = MLADims.from_hf_config({"hidden_size": 32, "num_attention_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 24,
                               "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
                               "num_hidden_layers": 1, "max_position_embeddings": 256})
#: past the last GPU wherever this runs (on a machine without CUDA: CUDA itself is missing)
PAST_LAST = f"cuda:{torch.cuda.device_count() + 7}"

ENTRY_POINTS = {
    "DecodeGraphMetadata": lambda d: DecodeGraphMetadata(2, 2, 4, 4, device=d),
    "shared_workspace": lambda d: shared_workspace(d, torch.float32, 8),
    "workspace_key": lambda d: workspace_key(d, torch.float32, 8),
    "LatentKVCache": lambda d: LatentKVCache(4, 4, 16, 8, device=d),
    "LatentKVCache.allocate": lambda d: LatentKVCache.allocate(DIMS, 4, 4, device=d),
    "IndexerKeyCache": lambda d: IndexerKeyCache(4, 4, 128, device=d),
    "BatchMetadata.build": lambda d: BatchMetadata.build([1], [3], [[0]], 4, device=d),
    "MLAAttention": lambda d: MLAAttention(DIMS, backend="REF_TORCH", dtype=torch.float32, device=d),
    "hadamard_matrix": lambda d: hadamard_matrix(4, device=d),
    "build_indexer": lambda d: build_indexer(DIMS, 0, dtype=torch.float32, device=d),  # dense: builds nothing
    "tunable_backends": lambda d: tunable_backends(DIMS, torch.float32, d),
    "check_grid_fits": lambda d: check_grid_fits(DIMS, [1], [8], torch.float32, d),
}


@pytest.mark.parametrize("device, exc", [("bogus", ValueError), ("sm9²", ValueError), (PAST_LAST, ValueError),
                                         ("", ValueError), (3.5, TypeError), (True, TypeError)])
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_every_device_argument_is_checked_naming_it(entry, device, exc):
    before = dict(shared_workspaces())
    with pytest.raises(exc, match=r"^device: got "):
        ENTRY_POINTS[entry](device)
    assert shared_workspaces() == before  # nothing created


@pytest.mark.parametrize("device", ["sm9²", "cuda:²", "sm٩٠", "cuda:٣"])
def test_simulated_device_specs_with_non_ascii_digits_name_the_argument(device):
    """``"²".isdigit()`` is True but ``int("²")`` fails: the selector's spec parser used to leak that error."""
    with pytest.raises(ValueError, match=r"^device: got "):
        parse_device_spec(device)
    with pytest.raises(ValueError, match=r"^device: got "):
        select_backend(DIMS, device=device)


def test_no_module_converts_a_device_argument_itself():
    """The class: ``torch.device(<a variable>)`` appears only inside ``validation.require_device``, so every
    device a caller gives goes through the one check (literals such as ``torch.device("cpu")`` are fine)."""
    found = []
    for path in sorted((ROOT / "mla_backends").rglob("*.py")):
        if path.name == "validation.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.device" and node.args \
                    and not isinstance(node.args[0], ast.Constant):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


# ---- Capabilities: every field's type ----------------------------------------------------------------------
BASE = dict(dtypes=frozenset({torch.float32}), kv_cache_dtypes=frozenset({"float32"}), cpu=True)
BOOL_FIELDS = [f.name for f in dataclasses.fields(Capabilities) if f.type in ("bool", bool)]


@pytest.mark.parametrize("name", BOOL_FIELDS)
@pytest.mark.parametrize("value", ["no", "False", 0, 1, None])
def test_capabilities_booleans_refuse_other_types(name, value):
    """``host_sync_free="no"`` used to be read as True."""
    with pytest.raises(TypeError, match=rf"malformed Capabilities: {name}: got {value!r}; supported True or False"):
        Capabilities(**{**BASE, name: value})


def test_every_capabilities_boolean_is_covered():
    assert {"cpu", "host_sync_free", "cuda_graphs", "dense", "sparse", "returns_lse", "deterministic"} <= \
        set(BOOL_FIELDS)


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(Capabilities)])
def test_every_capabilities_field_of_the_wrong_type_is_a_type_error_naming_it(name):
    with pytest.raises(TypeError, match=rf"malformed Capabilities: (.*; )?{name}: got "):
        Capabilities(**{**BASE, name: object()})


def test_an_inconsistent_capabilities_value_stays_a_value_error():
    with pytest.raises(ValueError, match="cuda_graphs: got True with host_sync_free False") as info:
        Capabilities(**BASE, cuda_graphs=True)
    assert not isinstance(info.value, TypeError)


# ---- alias helpers and dcp_group ---------------------------------------------------------------------------
@pytest.mark.parametrize("helper", [aliases.alias_target, aliases.alias_note, aliases.not_provided_note,
                                    lambda n: aliases.name_clash_note(n, (10, 0))])
@pytest.mark.parametrize("name", [5, None, b"CUTLASS_MLA", ["trtllm_mla"]])
def test_alias_helpers_refuse_a_non_string_naming_it(helper, name):
    with pytest.raises(TypeError, match=r"^name: got .*; supported a backend name \(str\)"):
        helper(name)


@pytest.mark.parametrize("group", ["world", 0, object(), [0, 1]])
def test_a_dcp_group_that_is_not_a_process_group_is_a_type_error(group):
    with pytest.raises(TypeError, match=r"^dcp_group: got \w+; supported a torch.distributed ProcessGroup"):
        MLAAttention(DIMS.tensor_parallel(2), backend="REF_TORCH", dtype=torch.float32, dcp_size=2, dcp_group=group)
    with pytest.raises(TypeError, match=r"^dcp_group: got "):  # not ignored without DCP either
        dcp_group_for(0, 2, 1, group)
    assert dcp_group_for(0, 2, 1, None) is None
