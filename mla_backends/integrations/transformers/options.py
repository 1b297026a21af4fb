"""What a patched model refuses: ``generate`` features, forward options and padding it cannot honour.

Every check here runs before the step (or the call) changes anything, and raises
:class:`UnsupportedGenerationError` (a ``NotImplementedError``: transformers runs it, a patched model does not)
or ``ValueError`` / ``TypeError`` for input that is malformed either way, naming the argument, what it got and
what is accepted.

- :func:`check_generate_options`: ``generate`` arguments (or ``generation_config`` fields) such as beam search.
- :func:`check_forward_options`: options of any forward (plain or inside ``generate``) that the patched
  attention cannot honour, such as ``output_attentions`` (it returns no weights).
- :func:`step_mask`: the step's 2-D ``attention_mask`` -> ``new [B, S]`` real-token flags, checked.
- :func:`check_left_padded` / :func:`check_prompt_mask`: the padding rule of a cache that lives past the step
  (``generate``'s), step by step and on the mask given to ``generate``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["UnsupportedGenerationError", "GENERATE_OPTIONS", "PACKED_SEQUENCE_KWARGS", "check_generate_options",
           "check_forward_options", "step_mask", "check_left_padded", "check_prompt_mask", "prompt_length",
           "longest_sequence"]


class UnsupportedGenerationError(NotImplementedError):
    """A ``generate`` feature or forward option a patched model does not run (beam search, assisted
    decoding, ``output_attentions``, right padding ...)."""


GENERATE_OPTIONS = (  # (generate argument, value meaning "off", feature named in the error)
    ("num_beams", 1, "beam search (num_beams > 1)"),
    ("num_beam_groups", 1, "group beam search (num_beam_groups > 1)"),
    ("penalty_alpha", None, "contrastive search (penalty_alpha)"),
    ("assistant_model", None, "assisted generation (assistant_model)"),
    ("prompt_lookup_num_tokens", None, "prompt lookup decoding (prompt_lookup_num_tokens)"),
    ("dola_layers", None, "DoLa decoding (dola_layers)"),
    ("cache_implementation", None, "cache_implementation (patched models manage their own cache)"),
    ("output_attentions", False, "output_attentions (patched attention returns no weights)"),
    ("use_cache", True, "generation without a cache (use_cache=False: a patched model always caches the latent)"),
)
#: flash-attention keywords that describe packed sequences (several requests in one row); the patched
#: attention reads the requests from ``attention_mask`` only, so it refuses them
PACKED_SEQUENCE_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _refuse(name: str, got: str, feature: str) -> None:
    raise UnsupportedGenerationError(f"{name}: got {got}; {feature} is not supported on a model patched by "
                                     "mla-backends (unpatch_model(model) to use it)")


def check_generate_options(model: torch.nn.Module, kwargs: dict) -> None:
    """Refuse a ``generate(**kwargs)`` call asking for a feature in :data:`GENERATE_OPTIONS` (read from
    ``kwargs``, else its ``generation_config``, else the model's)."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    for name, off, feature in GENERATE_OPTIONS:
        value = kwargs[name] if name in kwargs else getattr(config, name, off)
        if value is not None and value != off and not (off == 1 and value is None):
            _refuse(name, repr(value), feature)


def check_forward_options(module: torch.nn.Module, kwargs: dict) -> None:
    """Refuse a forward of the decoder stack ``module`` (its call keywords ``kwargs``) with an option the
    patched attention cannot honour: ``output_attentions`` (keyword, else ``module.config``) and packed
    sequences (:data:`PACKED_SEQUENCE_KWARGS`)."""
    value = kwargs.get("output_attentions")
    if value is None:
        value = getattr(getattr(module, "config", None), "output_attentions", False)
    if value:
        _refuse("output_attentions", repr(value), "returning attention weights (patched attention computes none)")
    for name in PACKED_SEQUENCE_KWARGS:
        if kwargs.get(name) is not None:
            _refuse(name, f"a {type(kwargs[name]).__name__}",
                    "packed sequences (requests are read from the 2-D attention_mask)")


def step_mask(mask: Any, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """``new [B, S]`` bool (True: a real token) of a step of ``shape = (B, S)`` new tokens from its
    ``attention_mask`` (None: every token real; else ``[B, L]`` 0/1 with ``L >= S``, the last ``S`` columns
    being the step's)."""
    B, S = shape
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise UnsupportedGenerationError(f"attention_mask: got {getattr(mask, 'shape', type(mask).__name__)}; "
                                         "patched models take a 2-D [batch, length] padding mask only")
    if mask.shape[0] != B or mask.shape[1] < S:
        raise ValueError(f"attention_mask: got shape {list(mask.shape)}; supported [{B}, L] with L >= {S} "
                         "(the batch of the input and at least its length)")
    return mask[:, -S:].to(torch.bool)


def check_left_padded(new: torch.Tensor, context: list[int], *, generating: bool) -> None:
    """The padding rule of a step into a cache that outlives it (``generate``'s): within a row, every token
    after its first real one is real (left padding), and a row has a real prompt token.

    ``new [B, S]`` bool is the step's real-token flags, ``context[b]`` the real tokens row ``b`` has cached,
    ``generating`` whether the whole prompt is cached already (a step of generated tokens; a row with nothing
    cached then had a prompt of padding only). transformers computes the first token of a right-padded row
    (or a row of padding only) from a padding position, whose output a patched model does not compute (it
    neither caches nor attends padding), so these are refused instead of answered differently.
    """
    rows = new.cpu()
    started = torch.tensor([c > 0 for c in context], dtype=torch.bool).unsqueeze(1)
    late = rows.logical_or(started).cummax(1).values & ~rows  # padding after a real token of the row
    bad = late.any(1).nonzero().flatten().tolist()
    if bad:
        raise UnsupportedGenerationError(
            f"attention_mask: row {bad[0]} has padding after a real token (right padding); a patched model's "
            "generate takes left-padded rows only (tokenizer padding_side='left', as transformers recommends)")
    if generating:
        empty = [b for b, c in enumerate(context) if c == 0]
        if empty:
            raise UnsupportedGenerationError(
                f"attention_mask: row {empty[0]} of the prompt is all padding; a patched model's generate needs "
                "at least one real token in every row")


def check_prompt_mask(mask: Any) -> None:
    """The ``attention_mask`` given to ``generate`` (when a 2-D tensor): no row of padding only, and left
    padding (checked again, step by step, for a mask transformers makes itself)."""
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.numel():
        rows = mask.to(torch.bool)
        empty = (~rows.any(1)).nonzero().flatten().tolist()
        if empty:
            raise UnsupportedGenerationError(
                f"attention_mask: row {empty[0]} is all padding; a patched model's generate needs at least one "
                "real token in every row")
        check_left_padded(rows, [0] * rows.shape[0], generating=False)


def prompt_length(args: tuple, kwargs: dict) -> int | None:
    """Tokens per request of the prompt of a ``generate(*args, **kwargs)`` call (its ``input_ids``, else
    ``inputs_embeds``), or None when it is not a ``[batch, length, ...]`` tensor."""
    prompt = kwargs.get("input_ids", args[0] if args else None)
    if prompt is None:
        prompt = kwargs.get("inputs_embeds")
    return prompt.shape[1] if isinstance(prompt, torch.Tensor) and prompt.dim() >= 2 else None


def longest_sequence(model: torch.nn.Module, args: tuple, kwargs: dict) -> int | None:
    """Tokens per request a ``generate(*args, **kwargs)`` call can reach (prompt + ``max_new_tokens``, else
    ``max_length``), or None when it cannot be told before the call."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    prompt = prompt_length(args, kwargs)
    new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    if prompt is not None and isinstance(new, int) and new >= 0:
        return max(1, prompt + new)
    longest = kwargs.get("max_length", getattr(config, "max_length", None))
    return longest if isinstance(longest, int) and longest >= 1 else None
