"""Argument helpers shared by the ``mla-backends`` subcommands (argparse types, the model options).

``--model`` takes a preset or a config.json and ``--tp`` a divisor of the model's heads; their errors name the
option, what was given and what is accepted.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

__all__ = ["load_model_dims", "refuse_v4", "load_model_config", "per_rank_dims", "int_list", "int_list_at_least",
           "int_at_least", "add_model_args", "csv_text", "check_output_file"]


def load_model_dims(spec: str) -> Any:
    """``--model``: an existing config.json (or a folder holding one) or a preset name; a DeepSeek-V4 config or
    preset gives :class:`~mla_backends.core.v4dims.V4Dims`."""
    from ..core.dims import PRESET_NAMES, MLADims
    from ..core.v4dims import V4_PRESET_NAMES, V4Dims, is_v4_config

    names = ", ".join((*PRESET_NAMES, *V4_PRESET_NAMES))
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--model: got {spec!r}; supported a preset ({names}) or a config.json")
    if os.path.exists(spec):
        try:
            return V4Dims.from_hf_config(spec) if is_v4_config(spec) else MLADims.from_hf_config(spec)
        except (ValueError, TypeError) as exc:  # the config's own error, under the option that named it
            raise type(exc)(f"--model: {exc}") from None
    if spec.endswith(".json") or os.sep in spec:
        raise ValueError(f"--model: got {spec!r}, which does not exist; supported a preset ({names}) or an existing "
                         "config.json")
    try:
        return V4Dims.preset(spec) if V4Dims.is_preset(spec) else MLADims.preset(spec)
    except ValueError:
        raise ValueError(f"--model: got {spec!r}; supported a preset ({names}) or a path to a config.json") from None


def refuse_v4(dims: Any, command: str) -> None:
    """``--model`` of a DeepSeek-V4 model where ``command`` models V2/V3 MLA only: a ValueError saying so."""
    from ..core.v4dims import V4Dims

    if isinstance(dims, V4Dims):
        raise ValueError(f"--model: got DeepSeek-V4 ({dims.name}) for `mla-backends {command}`; supported a "
                         "DeepSeek-V2/V3-style MLA model (V4 runs every request through one absorbed path; "
                         "`mla-backends kv-cache` sizes its pools)")


def load_model_config(spec: str) -> dict[str, Any] | None:
    """``--model``'s config.json for the deployment sizing (None for a preset): its MLP/MoE fields checked
    as the layer checks its own (:meth:`mla_backends.planning.deployment.ModelShape.from_config`), the error under
    ``--model`` (``--model: config.vocab_size: missing; ...``)."""
    from ..core.dims import read_config_json
    from ..planning.deployment import ModelShape

    if not os.path.exists(spec):
        return None
    try:
        config = read_config_json(spec)
        ModelShape.from_config(config, source=spec)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"--model: {exc}") from None
    return config


def int_list(text: str) -> list[int]:
    """An argparse ``type``: comma-separated positive ints (``"1,16"`` -> ``[1, 16]``)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; supported comma-separated positive ints") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"got {text!r}; supported comma-separated positive ints")
    return values


def int_list_at_least(minimum: int) -> Callable[[str], list[int]]:
    """An argparse ``type``: one int or a comma-separated list, each ``>= minimum`` (``"0,300"`` -> ``[0, 300]``)."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            values = []
        if not values or any(v < minimum for v in values):
            raise argparse.ArgumentTypeError(f"got {text!r}; supported an int >= {minimum} or a "
                                             "comma-separated list of them")
        return values

    return parse


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an int ``>= minimum``, else ``got X; supported an int >= minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"got {text!r}; supported an int >= {minimum}")
        return value

    return parse


def add_model_args(p: argparse.ArgumentParser, *, tp: int = 1, tp_help: str = "tensor-parallel size") -> None:
    """``--model``, ``--tp`` (default ``tp``) and ``--json``, shared by kv-cache, crossover and tune."""
    p.add_argument(
        "--model",
        default="deepseek-v3",
        metavar="PRESET|config.json",
        help="a preset (deepseek-v3, deepseek-v3.2, kimi-k2, ...) or a config.json (default deepseek-v3)",
    )
    p.add_argument("--tp", type=int, default=tp, metavar="N", help=f"{tp_help} (default {tp})")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def csv_text(values: Any) -> str:
    """``(1, 16)`` -> ``"1,16"``: a default list as ``--help`` shows it."""
    return ",".join(map(str, values))


def per_rank_dims(dims: Any, tp: int) -> Any:
    """``--tp``: the per-rank view ``dims.tensor_parallel(tp)``, its error worded for the command line."""
    try:
        return dims.tensor_parallel(tp)
    except ValueError:
        raise ValueError(
            f"--tp: got {tp}; supported a positive divisor of the model's {dims.num_heads} heads"
        ) from None


def check_output_file(option: str, path: str | None) -> None:
    """Refuse an output file that cannot be written, before any work: its folder must exist and be writable,
    ``path`` must not be a folder, and the file itself must open for writing (tried: opened for appending,
    so an existing file keeps its contents, and removed again when it did not exist; a name too long for
    the file system fails here). ``ValueError`` naming ``option``."""
    if path is None:
        return
    if not path or os.path.isdir(path):
        raise ValueError(f"{option}: got {path!r}, which is a folder; supported a file path")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{option}: got {path!r}, but the folder {folder} does not exist; supported a file in "
                         "an existing folder")
    existed = os.path.exists(path)
    try:
        with open(path, "a", encoding="utf-8"):
            pass
        if not existed:
            os.remove(path)
    except OSError as exc:
        raise ValueError(f"{option}: got {path!r}, which cannot be written ({exc.strerror or exc}); supported a "
                         "writable file path") from None
