"""transformers' own ``generate()`` on mla-backends: :func:`patch_model` / :func:`unpatch_model`.

::

    from mla_backends.integrations.transformers import patch_model, unpatch_model
    model = patch_model(model, backend=None, kv_cache_dtype="auto", block_size=None)  # the same model
    model.generate(input_ids, attention_mask=mask, max_new_tokens=64, do_sample=False)
    unpatch_model(model)                                                              # the original modules

Every ``DeepseekV2Attention`` / ``DeepseekV3Attention`` of the model is replaced by a
:class:`PatchedMLAAttention` holding an :class:`~mla_backends.layer.attention.MLAAttention` loaded with the module's own
weights (``kv_b_proj`` folded once); every ``DeepseekV4Attention`` by one holding a
:class:`~mla_backends.layer.v4.V4Attention` (its window, compressed, state and indexer stores in the same paged
pool; each request's compressor windows count its own tokens only, so a left-padded batch generates what each
prompt generates alone). The latent rows live in a paged cache per layer, owned by a
:class:`MLAGenerationCache` (a transformers ``Cache``): ``generate`` is wrapped so that each call gets a new
one, sized at its first step for the call's longest sequence (prompt + ``max_new_tokens``, so decode steps
never reallocate or copy it), grown only if that bound is exceeded, and released when the call returns.

How a step maps onto :class:`~mla_backends.step.metadata.BatchMetadata`: a forward pre-hook on the decoder stack
reads the 2-D ``attention_mask``; request ``b``'s new real (unmasked) tokens are its query, its real tokens
cached so far its context, and padding is neither written nor attended. RoPE positions are the model's own
``position_ids`` (left padding shifts them as transformers does). Decode steps (one token) run absorbed
through the backend's ``forward_mqa``; prefills go through the shared ``forward_mha``. The attention outputs of
padding positions are zeros, not transformers'; ``generate`` takes left-padded rows only, so it never reads
one (right padding and rows of padding only are refused, :mod:`.options`).

The package: :mod:`.cache` (the call's cache and page pool), :mod:`.attention` (the patched module, the
step hooks and the process-wide step gate that lets threads share a model), :mod:`.options` (what is
refused). Threads may call one patched model (or its copies) at once.

Copies and pickles: ``copy.deepcopy`` of a patched model is a patched model of its own weights, and so is a
pickled one once loaded (``pickle``, ``torch.save`` / ``torch.load(weights_only=False)``): its ``generate``,
hooks and layers are its own. ``copy.copy`` (a shallow copy) is *shared*, as for any ``nn.Module``: the copy
holds the same modules, weights and patch, generates the same tokens, and is patched exactly as long as the
original is; :func:`unpatch_model` refuses it (unpatch the original), since undoing the patch through the copy
would change the original under it.

Supported transformers versions: the ``transformers`` extra of ``pyproject.toml`` (tested on 5.17 and 5.24).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from ...core.validation import require_int
from ...layer.attention import MLAAttention
from ...layer.v4 import V4Attention
from .attention import STEP_GATE, PatchedMLAAttention, PatchState, after_forward, before_forward
from .cache import DEFAULT_BLOCK_SIZE, MAX_RESERVE_TOKENS, MLAGenerationCache
from .options import (
    UnsupportedGenerationError,
    check_generate_options,
    check_prompt_mask,
    longest_sequence,
    prompt_length,
)

__all__ = ["patch_model", "unpatch_model", "is_patched", "PatchedMLAAttention", "PatchedGenerate",
           "MLAGenerationCache",
           "UnsupportedGenerationError", "DEFAULT_BLOCK_SIZE", "MAX_RESERVE_TOKENS"]

_ATTENTION_CLASSES = ("DeepseekV2Attention", "DeepseekV3Attention", "DeepseekV4Attention")
#: the attention class of DeepSeek-V4, patched with a V4Attention
_V4_CLASS = "DeepseekV4Attention"
_STATE_ATTR = "_mla_backends_patch"


def _decoder_stack(model: torch.nn.Module) -> torch.nn.Module:
    """The module that runs the decoder layers (``model.model`` of a ``...ForCausalLM``)."""
    for cand in (getattr(model, "model", None), model):
        if isinstance(cand, torch.nn.Module) and isinstance(getattr(cand, "layers", None), torch.nn.ModuleList):
            return cand
    raise TypeError(f"model: got {type(model).__name__} without a decoder stack (.model.layers); supported "
                    "transformers' DeepseekV2ForCausalLM / DeepseekV3ForCausalLM or their base models")


class PatchedGenerate:
    """``model.generate`` of a patched model, giving each call its own cache. It holds the model it belongs to,
    and pickles, deep-copies and shallow-copies as a reference to it: the unpickled or deep-copied model's
    ``generate`` is its own (bound to it, with its own state, layers and weights), and a shallow copy
    (``copy.copy``), which shares the original's modules, shares the original's ``generate`` too."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        functools.update_wrapper(self, type(model).generate)

    def __reduce__(self) -> tuple[Any, tuple[torch.nn.Module]]:
        return PatchedGenerate, (self.model,)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        original = type(model).generate
        state: PatchState | None = model.__dict__.get(_STATE_ATTR)
        if state is None:  # unpatched since (this is a shallow copy's view of it): the plain generate
            return original(model, *args, **kwargs)
        check_generate_options(model, kwargs)
        check_prompt_mask(kwargs.get("attention_mask"))
        given = kwargs.get(state.cache_kw)
        if given is not None and not isinstance(given, MLAGenerationCache):
            raise TypeError(f"{state.cache_kw}: got {type(given).__name__}; a patched model makes its own "
                            "MLAGenerationCache per generate call (pass none)")
        cache = given if given is not None else state.new_cache(longest_sequence(model, args, kwargs))
        cache.prompt_tokens = prompt_length(args, kwargs)  # past it, every row must have a real token cached
        kwargs[state.cache_kw] = cache
        try:
            return original(model, *args, **kwargs)
        finally:
            STEP_GATE.abandon()  # a step this thread never ended (an interrupted forward): its gate is let go
            STEP_GATE.leave()
            if given is None:
                cache.release()


def _claimed_state(model: torch.nn.Module) -> PatchState | None:
    """``model``'s patch state; a deep-copied or unpickled state (no owner yet) becomes ``model``'s."""
    state = getattr(model, "__dict__", {}).get(_STATE_ATTR)
    if state is not None and state.model is None:
        state.model = model
    return state


def _own_state(model: torch.nn.Module, action: str) -> PatchState | None:
    """``model``'s patch state, None when it has none; a state that belongs to another model (``model`` is a
    shallow copy, ``copy.copy``, sharing that model's modules) is refused for ``action``."""
    state = _claimed_state(model)
    if state is not None and state.model is not model:
        raise ValueError(f"model: got a shallow copy (copy.copy) of a patched model, which shares that model's "
                         f"modules and patch; supported {action} on the model patch_model patched (or on a "
                         "copy.deepcopy of it, which is patched on its own)")
    return state


def patch_model(model: torch.nn.Module, *, backend: Any = None, kv_cache_dtype: str = "auto",
                block_size: int | None = None) -> torch.nn.Module:
    """Run every DeepSeek-V2/V3 attention module of ``model`` on :class:`MLAAttention` (DeepSeek-V4's on
    :class:`~mla_backends.layer.v4.V4Attention`); returns ``model``.

    Args:
        model: a transformers ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` / ``DeepseekV4ForCausalLM``
            (or any model whose decoder layers hold ``DeepseekV2Attention`` / ``DeepseekV3Attention`` /
            ``DeepseekV4Attention`` modules).
        backend: backend name or class for ``forward_mqa``; None = the selector's choice for the device.
        kv_cache_dtype: latent cache dtype (``"auto"``: the model dtype; ``"fp8_e4m3"`` where the backend can).
        block_size: tokens per cache page (default :data:`DEFAULT_BLOCK_SIZE`).

    The layers take the modules' weights, dtype and device as they are now. Raises TypeError for a model
    without such modules and ValueError for one already patched.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: got {type(model).__name__}; supported a transformers DeepSeek model")
    if _own_state(model, "patch_model") is not None:
        raise ValueError("model: got a model already patched by mla-backends; call unpatch_model(model) first")
    if not isinstance(kv_cache_dtype, str):
        raise TypeError(f"kv_cache_dtype: got {type(kv_cache_dtype).__name__}; supported a name such as 'auto'")
    bs = DEFAULT_BLOCK_SIZE if block_size is None else require_int("block_size", block_size, minimum=1)
    stack = _decoder_stack(model)
    found = [(name, mod) for name, mod in model.named_modules() if type(mod).__name__ in _ATTENTION_CLASSES]
    if not found:
        raise TypeError(f"model: got {type(model).__name__} without DeepseekV2/V3/V4Attention modules; supported "
                        "transformers' DeepSeek-V2/V3/V4 models")
    fwd = inspect.signature(stack.forward).parameters
    state = PatchState(model, {}, bs, kv_cache_dtype, "cache" if "cache" in fwd else "past_key_values")
    replacements = []
    for name, mod in found:
        if type(mod).__name__ == _V4_CLASS:
            weight = mod.q_b_proj.weight
            mla = V4Attention.from_hf_config(mod.config, backend=backend, dtype=weight.dtype, device=weight.device,
                                             layer_idx=mod.layer_idx)
        else:
            weight = mod.kv_b_proj.weight
            mla = MLAAttention.from_hf_config(mod.config, backend=backend, dtype=weight.dtype, device=weight.device,
                                              layer_idx=mod.layer_idx)
        mla.load_hf_state_dict(mod.state_dict())
        if mla.layer_idx in state.layers:
            raise ValueError(f"model: two attention modules claim layer_idx {mla.layer_idx}")
        state.layers[mla.layer_idx] = mla
        replacements.append((name, mod, PatchedMLAAttention(mla, state)))
    # every layer built and loaded: now swap (nothing is changed when a layer above raised)
    for name, mod, new in replacements:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
        state.originals[name] = mod
    state.hooks.append(stack.register_forward_pre_hook(functools.partial(before_forward, state),
                                                       with_kwargs=True))
    state.hooks.append(stack.register_forward_hook(functools.partial(after_forward, state), with_kwargs=True,
                                                   always_call=True))
    model.__dict__[_STATE_ATTR] = state
    if callable(getattr(type(model), "generate", None)):  # a bare decoder stack has no generate() to wrap
        model.__dict__["generate"] = PatchedGenerate(model)
    return model


def is_patched(model: torch.nn.Module) -> bool:
    """Whether :func:`patch_model` patched ``model`` (and :func:`unpatch_model` has not undone it); a shallow
    copy (``copy.copy``) of a patched model is patched as long as the original is."""
    state = _claimed_state(model)
    return state is not None and state.active


def unpatch_model(model: torch.nn.Module) -> torch.nn.Module:
    """Put the original attention modules, ``forward`` hooks and ``generate`` back; returns ``model``. A shallow
    copy (``copy.copy``) is refused: its modules are the original's (unpatch the original)."""
    state = _own_state(model, "unpatch_model")
    if state is None:
        raise ValueError(f"model: got a {type(model).__name__} that patch_model did not patch")
    del model.__dict__[_STATE_ATTR]
    state.active = False  # shallow copies holding the same state see it
    model.__dict__.pop("generate", None)
    for handle in state.hooks:
        handle.remove()
    for name, mod in state.originals.items():
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, mod)
    return model
