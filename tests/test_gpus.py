"""The package's one GPU table (mla_backends.core.gpus), its generated page and the decode roofline."""

from __future__ import annotations

import pytest

from docgen.gpus import GPUS_DOC_PATH, main, render_gpus_doc
from mla_backends.core.dims import MLADims
from mla_backends.core.gpus import GPU_TABLE, gpu_spec, gpu_spec_for_device_name, known_gpu_names
from mla_backends.planning.roofline import decode_roofline


def test_required_products_and_vendor_figures():
    for key in ("a100", "h100", "h200", "h20", "b200", "gb200", "b300", "rtx5090", "rtx-pro-6000", "l40s",
                "l4", "a10"):
        assert key in known_gpu_names()
    h200 = gpu_spec("h200")
    assert h200.sms == 132 and h200.compute_capability == (9, 0) and h200.datasheet_memory_gb == 141
    assert h200.bandwidth_bytes_per_s == 4.8e12 and h200.bf16_tflops == pytest.approx(989.4)
    assert h200.ridge_flop_per_byte() == pytest.approx(206.1, abs=0.1)
    assert h200.ridge_flop_per_byte(fp8_mma=True) == pytest.approx(412.3, abs=0.1)
    assert gpu_spec("a100").fp8_tflops is None and gpu_spec("a100").tensor_flops_per_s(True) == 312e12
    assert gpu_spec("b300").compute_capability == (10, 3) and gpu_spec("rtx5090").sm_label == "sm120"
    assert len({g.key for g in GPU_TABLE}) == len(GPU_TABLE)


# what published nvidia-smi output shows as the total, in MiB (each row's memory_source cites it)
DRIVER_MIB = {"h200": 143_771, "h100": 81_559, "a100": 81_920, "a100-40gb": 40_960, "a10": 23_028, "l4": 23_034,
              "l40s": 46_068, "rtx4090": 24_564, "h20": 97_871, "b200": 183_359, "rtx-pro-6000": 97_887,
              "rtx5090": 32_607}


def test_memory_is_what_the_driver_reports():
    """The table holds the driver's total (nvidia-smi MiB), not the data sheet's GB: an H200 is 143,771 MiB =
    150,754,820,096 bytes (140.4 GiB), 6.9% more than the 141e9 of its data sheet."""
    assert gpu_spec("h200").memory_bytes == 143_771 * 2**20 == 150_754_820_096
    assert gpu_spec("h100").memory_bytes == 81_559 * 2**20 == 85_520_809_984
    for key, mib in DRIVER_MIB.items():
        g = gpu_spec(key)
        assert g.memory_bytes == mib * 2**20 and g.memory_confirmed, key
        assert f"{mib}MiB" in g.memory_source and "#" in g.memory_source, key  # names the thread it is from
    unconfirmed = {g.key for g in GPU_TABLE if not g.memory_confirmed}
    assert unconfirmed == {"a100-pcie", "h100-pcie", "h100-nvl", "h800", "gb200", "b300", "gb300"}
    for g in GPU_TABLE:
        assert g.memory_source, g.key  # every row says where its figure comes from
        assert g.memory_confirmed or "not" in g.memory_source or "no " in g.memory_source, g.key
    assert gpu_spec("h100-pcie").memory_bytes == 80 * 10**9  # no driver figure found: the data sheet's, flagged
    page = render_gpus_doc()
    assert "| 143,771 MiB HBM3e | 141 |" in page and "`h200`: nvidia-smi 143771MiB: sgl-project/sglang#3196" in page
    assert "80 GB (not confirmed)" in page and "`h800`: nvidia-smi listing seen" in page


@pytest.mark.parametrize("spelling", ["H200", "h200", " h-200 ", "H_200", "h200-sxm"])
def test_lookup_ignores_case_dashes_and_underscores(spelling):
    assert gpu_spec(spelling).key == "h200"
    assert gpu_spec("RTX_PRO_6000").key == gpu_spec("rtx pro 6000").key == "rtx-pro-6000"


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"gpu name: got 'v100'; supported a100, .*h200.*rtx5090"):
        gpu_spec("v100")
    with pytest.raises(TypeError, match="gpu name: got int"):
        gpu_spec(90)  # type: ignore[arg-type]


@pytest.mark.parametrize("reported,key", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H200", "h200"), ("NVIDIA H20", "h20"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA A100 80GB PCIe", "a100-pcie"), ("NVIDIA A10", "a10"),
    ("NVIDIA B200", "b200"), ("NVIDIA GB200", "gb200"), ("NVIDIA GeForce RTX 5090", "rtx5090"),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "rtx-pro-6000"), ("NVIDIA L4", "l4"),
])
def test_driver_names_map_to_the_most_specific_row(reported, key):
    assert gpu_spec_for_device_name(reported).key == key


def test_unknown_driver_name_is_none():
    assert gpu_spec_for_device_name("NVIDIA GeForce RTX 3060") is None


def test_gpus_doc_matches_the_table(tmp_path):
    assert GPUS_DOC_PATH.read_text() == render_gpus_doc(), "docs/gpus.md is stale: python -m docgen.gpus"
    stale = tmp_path / "gpus.md"
    stale.write_text(render_gpus_doc().replace("989.4", "990", 1))
    assert main(["--check", "--path", str(stale)]) == 1
    assert main(["--path", str(stale)]) == 0 and main(["--check", "--path", str(stale)]) == 0


def test_roofline_128_heads_bf16_on_h200_is_compute_bound():
    h200 = gpu_spec("h200")
    dims = MLADims(num_heads=128)
    # cache rows only dominate at long contexts: 242 FLOP/B per row against the ridge of 206
    r = decode_roofline(dims, [16384] * 64, cache_bytes=2, peak_bytes_per_s=h200.bandwidth_bytes_per_s,
                        peak_flops_per_s=h200.tensor_flops_per_s())
    assert r.flops == 64 * 16384 * 2 * 128 * (576 + 512)
    assert r.bytes == 64 * 16384 * 1152 + 64 * 128 * (576 + 512) * 2
    assert r.bound == "compute" and r.intensity > h200.ridge_flop_per_byte()
    assert r.roofline_us == pytest.approx(r.flops / 989.4e12 * 1e6)
    # fp8 halves the cache bytes; 16 heads stay memory-bound
    fp8 = decode_roofline(dims, [16384] * 64, cache_bytes=1, peak_bytes_per_s=4.8e12, peak_flops_per_s=989.4e12)
    assert fp8.bytes < r.bytes and fp8.bound == "compute"
    small = decode_roofline(MLADims(num_heads=16), [16384] * 64, cache_bytes=2, peak_bytes_per_s=4.8e12,
                            peak_flops_per_s=989.4e12)
    assert small.bound == "memory" and small.roofline_us == pytest.approx(small.memory_us)


def test_roofline_rejects_bad_input():
    dims = MLADims(num_heads=16)
    with pytest.raises(ValueError, match=r"seq_lens\[1\]: got -1"):
        decode_roofline(dims, [3, -1], cache_bytes=2, peak_bytes_per_s=1.0, peak_flops_per_s=1.0)
    with pytest.raises(ValueError, match="peak_bytes_per_s: got 0"):
        decode_roofline(dims, [3], cache_bytes=2, peak_bytes_per_s=0, peak_flops_per_s=1.0)
    with pytest.raises(ValueError, match="query_lens: got 2 entries"):
        decode_roofline(dims, [3], cache_bytes=2, peak_bytes_per_s=1.0, peak_flops_per_s=1.0, query_lens=[1, 1])
