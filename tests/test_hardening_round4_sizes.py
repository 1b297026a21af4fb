"""Issue 37, part 5: sizes on the command line are read exactly, overflow names the flag and the limit, and a
deployment that does not fit blames the flag whose value cannot fit (text and ``--json``).

The expected byte counts are computed here with :class:`fractions.Fraction` from the decimal text (an
independent exact reading), or written out by hand.
"""

from __future__ import annotations

import json
import math
import random
from fractions import Fraction

import pytest

from mla_backends import deployment
from mla_backends.cli import main, reports
from mla_backends.core.dims import MLADims

UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30,
         "TiB": 2**40, "": 2**30}
LIMIT = 2**53


def _expected(number: str, unit: str) -> int:
    return math.floor(Fraction(number) * UNITS[unit])


def _json(capsys, *argv: str) -> tuple[int, dict]:
    rc = main(["kv-cache", *argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


# ---- exact reading --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "nbytes"), [
    ("4.35TB", 4_350_000_000_000), ("8.2GB", 8_200_000_000), ("0.3GB", 300_000_000), ("2.675GB", 2_675_000_000),
    ("1.15e3MB", 1_150_000_000), ("0.1", 107_374_182), ("1.1TiB", 1_209_462_790_553), ("150.75GB", 150_750_000_000),
    ("143771MiB", 143_771 * 2**20), ("4.35e-3TB", 4_350_000_000), ("1E+1gb", 10**10),
])
def test_sizes_are_exact(text: str, nbytes: int) -> None:
    assert deployment.parse_memory(text) == nbytes
    assert deployment.parse_memory(text, "--reserve", allow_zero=True) == nbytes


def test_random_decimal_sizes_are_exact() -> None:
    rng = random.Random(37)
    for _ in range(2000):
        unit = rng.choice(list(UNITS))
        number = f"{rng.randrange(1, 10**6)}.{rng.randrange(0, 10**4):04d}"
        if rng.random() < 0.3:
            number += f"e{rng.randrange(-3, 3)}"
        want = _expected(number, unit)
        if 0 < want <= LIMIT:
            assert deployment.parse_memory(number + unit) == want, number + unit


@pytest.mark.parametrize(("flag", "key", "extra", "text"), [
    *[("--gpu-memory", "gpu_memory_bytes", ["--tp", "8"], t) for t in ("4.35TB", "182.2GB", "2.675TB", "170.7GiB")],
    *[("--reserve", "reserve_bytes", ["--gpu", "h200", "--tp", "8"], t) for t in ("8.2GB", "2.675GB", "0.7GiB",
                                                                                   "4.35GB")],
    *[("--cache-memory", "gpu_memory_bytes", [], t) for t in ("4.35TB", "8.2GB", "2.675GB", "0.7GiB")],
])
def test_every_size_flag_reads_exactly(capsys, flag: str, key: str, extra: list[str], text: str) -> None:
    number = text.rstrip("GiTB")
    unit = text[len(number):]
    rc, rep = _json(capsys, *extra, flag, text)
    assert rc == 0, rep
    assert rep[key] == _expected(number, unit)


def test_cache_memory_text_names_the_size_as_written(capsys) -> None:
    assert main(["kv-cache", "--cache-memory", "42.9GB"]) == 0
    out = capsys.readouterr().out
    assert "42.9GB holds " in out
    assert main(["kv-cache", "--cache-memory", "40"]) == 0
    assert "40 GiB holds " in capsys.readouterr().out


# ---- overflow: the flag and the limit -----------------------------------------------------------------
@pytest.mark.parametrize(("flag", "extra"), [
    ("--gpu-memory", ["--tp", "8"]), ("--reserve", ["--gpu", "h200", "--tp", "8"]), ("--cache-memory", []),
])
@pytest.mark.parametrize("text", ["1e300GB", "1e300", "9007199254740993", "8193TiB",
                                  "1e99999999999999999999GB", "9007199254740993KB"])
def test_oversized_sizes_name_the_flag_and_the_limit(capsys, flag: str, extra: list[str], text: str) -> None:
    rc = main(["kv-cache", *extra, flag, text])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and "OverflowError" not in err, err
    assert f"{flag}: got {text!r}" in err and "at most 9,007,199,254,740,992 bytes" in err, err
    rc, rep = _json(capsys, *extra, flag, text)
    assert rc == 2 and rep["error"]["argument"] == flag, rep


@pytest.mark.parametrize("text", ["1e-30GB", "0.0000000001KB"])
def test_sizes_under_one_byte_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="less than one byte"):
        deployment.parse_memory(text, "--reserve", allow_zero=True)
    with pytest.raises(ValueError, match=r"^--gpu-memory: got .*less than one byte"):
        deployment.parse_memory(text)


def test_library_sizes_past_the_limit_name_the_argument() -> None:
    v3 = MLADims.deepseek_v3()
    for big in (2**53 + 1, 10**400):
        with pytest.raises(ValueError, match="^--gpu-memory: got .*supported at most 9,007,199,254,740,992"):
            reports.deployment_report(v3, gpu_memory_bytes=big, tp=8)
        with pytest.raises(ValueError, match="^--reserve: got .*supported at most 9,007,199,254,740,992"):
            reports.deployment_report(v3, gpu_memory_bytes=10**12, tp=8, reserve_bytes=big)
        with pytest.raises(ValueError, match="^cache_memory_bytes: got"):
            reports.kv_cache_report(v3, cache_memory_bytes=big)


# ---- the flag that cannot fit is the one blamed ----------------------------------------------------------
@pytest.mark.parametrize(("reserve", "whole"), [("60GB", False), ("149GB", False), ("200GB", True),
                                                ("8000TB", True)])
def test_a_reserve_that_does_not_fit_blames_reserve(capsys, reserve: str, whole: bool) -> None:
    rc = main(["kv-cache", "--gpu", "h200", "--tp", "8", "--reserve", reserve])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("error: --reserve: got ") == 1 and "--tp" not in err, err
    assert ("more than the GPU's whole memory" in err) is whole, err
    room = int(err.split("supported a reserve of less than ")[1].split(" bytes")[0].replace(",", ""))
    # the room is exact: one byte less fits, the room itself leaves the cache nothing
    for nbytes, status in ((room - 1, 0), (room, 2)):
        text = f"{nbytes // 1000}.{nbytes % 1000:03d}KB"
        assert main(["kv-cache", "--gpu", "h200", "--tp", "8", "--reserve", text]) == status, text
    capsys.readouterr()
    rc, rep = _json(capsys, "--gpu", "h200", "--tp", "8", "--reserve", reserve)
    assert rc == 2 and rep["error"]["argument"] == "--reserve" and "larger --tp" not in rep["error"]["message"]


@pytest.mark.parametrize("tokens", [10**6, 10**30, 10**400])
def test_an_absurd_token_budget_blames_max_num_batched_tokens(capsys, tokens: int) -> None:
    argv = ["--gpu", "h200", "--tp", "8", "--max-num-batched-tokens", str(tokens)]
    rc = main(["kv-cache", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and "--max-num-batched-tokens: got " in err, err
    assert "supported a larger --tp" not in err
    most = int(err.split("supported at most ")[1].split(" tokens")[0].replace(",", ""))
    rc, rep = _json(capsys, "--gpu", "h200", "--tp", "8", "--max-num-batched-tokens", str(most))
    assert rc == 0 and rep["cache_bytes_per_rank"] > 0  # the largest budget that fits does fit
    rc, rep = _json(capsys, "--gpu", "h200", "--tp", "8", "--max-num-batched-tokens", str(most + 1))
    assert rc == 2 and rep["error"]["argument"] == "--max-num-batched-tokens"
    assert f"supported at most {most:,} tokens" in rep["error"]["message"]


def test_weights_that_do_not_fit_still_blame_tp(capsys) -> None:
    rc, rep = _json(capsys, "--gpu", "h200", "--tp", "1")
    assert rc == 2 and rep["error"]["argument"] == "--tp"
    assert "before any reserve" in rep["error"]["message"]
    rc, rep = _json(capsys, "--gpu", "h200", "--tp", "1", "--reserve", "1000TB")  # weights first
    assert rc == 2 and rep["error"]["argument"] == "--tp"
