"""The patched attention modules and the decoder-stack hooks that run one step: :class:`PatchedMLAAttention`.

A step is one forward of the decoder stack. Its pre-hook (:func:`before_forward`) checks the options and the
``attention_mask``, starts the step on the call's :class:`MLAGenerationCache` and enters the process-wide
:data:`STEP_GATE`; the layers' :class:`PatchedMLAAttention` read the step's cache from the gate; the forward hook
(:func:`after_forward`, run even when the forward raises) ends the step and leaves the gate.

Why a gate: the call's cache and metadata belong to the call, but the layers share what lives beyond a step's
inputs: the prefill workspace of the device (:func:`mla_backends.layer.workspace.shared_workspace`, one per device,
dtype and stream, whatever the model) and the backends' per-step preparation. So the steps of patched models
run one at a time in a process (threads take turns, step by step), and a model, its copies and other patched
models can be called from several threads at once with every call getting its own answer.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ...layer.attention import MLAAttention
from .cache import MLAGenerationCache
from .options import check_forward_options, check_left_padded, step_mask

__all__ = ["PatchedMLAAttention", "PatchState", "StepGate", "STEP_GATE", "before_forward", "after_forward",
           "CACHE_KWARGS"]

#: the decoder stack's cache keyword (transformers 5.x renames ``past_key_values`` to ``cache``)
CACHE_KWARGS = ("cache", "past_key_values")


class PatchState:
    """What :func:`~mla_backends.integrations.transformers.patch_model` keeps on the model: the model it
    patched (``model``: a shallow copy of that model shares this state, and is told apart by it), its layers,
    the cache settings, the original modules and the hook handles, and whether the patch is still on
    (``active``). Nothing per call or per step (that is the call's cache and :data:`STEP_GATE`), so
    ``copy.deepcopy`` and pickling of the model copy it whole."""

    def __init__(self, model: torch.nn.Module, layers: dict[int, MLAAttention], block_size: int,
                 kv_cache_dtype: str, cache_kw: str) -> None:
        self.model = model
        self.active = True
        self.layers = layers
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.cache_kw = cache_kw
        self.originals: dict[str, torch.nn.Module] = {}
        self.hooks: list[Any] = []

    def __getstate__(self) -> dict[str, Any]:
        """A deep copy or a pickle of the state leaves ``model`` unset: the model it is copied with claims it
        (:func:`~mla_backends.integrations.transformers.is_patched` and friends), not a copy of the original."""
        return {**self.__dict__, "model": None}

    def new_cache(self, reserve_tokens: int | None = None) -> MLAGenerationCache:
        return MLAGenerationCache(self.layers, block_size=self.block_size, kv_cache_dtype=self.kv_cache_dtype,
                                  reserve_tokens=reserve_tokens)


class StepGate:
    """One patched step at a time in the process: who runs it (thread, model state) and on which cache."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.thread: int | None = None
        self.state: PatchState | None = None
        self.cache: MLAGenerationCache | None = None
        self.temporary = False

    def enter(self, state: PatchState, cache: MLAGenerationCache, temporary: bool) -> None:
        """Wait for the gate, then hold it for ``state``'s step on ``cache`` (``temporary``: released after)."""
        if self.thread == threading.get_ident():
            self.abandon()  # this thread's previous step never ended (interrupted): drop it, keep the gate
        else:
            self._lock.acquire()
        self.thread, self.state, self.cache, self.temporary = threading.get_ident(), state, cache, temporary

    def leave(self) -> tuple[MLAGenerationCache, bool] | None:
        """Let the gate go if this thread holds it: ``(cache, temporary)`` of the step, else None."""
        if self.thread != threading.get_ident():
            return None
        held = (self.cache, self.temporary)
        self.thread, self.state, self.cache, self.temporary = None, None, None, False
        self._lock.release()
        return held  # type: ignore[return-value]

    def abandon(self) -> None:
        """End this thread's step without counting it (a forward that never returned), gate kept."""
        if self.thread == threading.get_ident() and self.cache is not None:
            self.cache.end_step(0, done=False)
            if self.temporary:
                self.cache.release()

    def cache_for(self, state: PatchState) -> MLAGenerationCache | None:
        """The cache of the step this thread runs on ``state``'s model, else None."""
        if self.thread == threading.get_ident() and self.state is state:
            return self.cache
        return None


#: the process-wide gate of patched steps
STEP_GATE = StepGate()


class PatchedMLAAttention(torch.nn.Module):
    """Stands in for one transformers DeepSeek attention module; ``mla`` does the work.

    ``forward(hidden_states [B, S, hidden], position_embeddings, attention_mask, ..., position_ids [B|1, S])``
    returns ``([B, S, hidden], None)`` like transformers' module (no attention weights).
    """

    def __init__(self, mla: MLAAttention, state: PatchState) -> None:
        super().__init__()
        self.mla = mla
        self.layer_idx = mla.layer_idx
        self._state = state

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Any = None, attention_mask: Any = None,
                *args: Any, position_ids: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        cache = STEP_GATE.cache_for(self._state)
        if cache is None or cache.step is None:
            raise RuntimeError("PatchedMLAAttention: called outside the patched model's forward; call the model")
        plan, real = cache.step
        B, S, hid = hidden_states.shape
        x = hidden_states.reshape(B * S, hid)
        x = x if real is None else x.index_select(0, real)
        positions = None
        if position_ids is not None:
            pos = position_ids.reshape(-1, position_ids.shape[-1])[:, -S:].expand(B, S).reshape(-1)
            positions = (pos if real is None else pos.index_select(0, real.to(pos.device))).to(x.device)
        y = self.mla(x, positions, cache.caches[self.layer_idx], plan)
        if real is None:
            return y.view(B, S, hid), None
        out = hidden_states.new_zeros(B * S, hid)
        out.index_copy_(0, real, y)
        return out.view(B, S, hid), None


def _step_shape(args: tuple, kwargs: dict) -> tuple[tuple[int, int], torch.device]:
    ids = kwargs.get("input_ids", args[0] if args else None)
    x = ids if ids is not None else kwargs.get("inputs_embeds")
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError("input_ids: got none (and no inputs_embeds); supported [batch, length] token ids")
    return (x.shape[0], x.shape[1]), x.device


def before_forward(state: PatchState, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """The decoder stack's forward pre-hook: check the step, start it on its cache, enter the gate."""
    check_forward_options(module, kwargs)
    shape, device = _step_shape(args, kwargs)
    cache = next((kwargs[k] for k in CACHE_KWARGS if kwargs.get(k) is not None), None)
    if cache is not None and not isinstance(cache, MLAGenerationCache):
        raise TypeError(f"{state.cache_kw}: got {type(cache).__name__}; a patched model keeps its latent rows in "
                        "an MLAGenerationCache (model.generate makes one per call); pass none for a plain forward")
    new = step_mask(kwargs.get("attention_mask"), shape, device)
    temporary = cache is None
    if temporary:
        cache = state.new_cache()
    else:  # a cache that outlives the step: transformers reads the next token from the last position
        cache.check_usable(shape[0])
        generating = cache.prompt_tokens is not None and cache.seen >= cache.prompt_tokens
        check_left_padded(new, cache.context if cache.pages else [0] * shape[0], generating=generating)
    cache.begin_step(new)
    STEP_GATE.enter(state, cache, temporary)


def after_forward(state: PatchState, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    """The decoder stack's forward hook (also run when the forward raised, ``output`` None): end the step."""
    held = STEP_GATE.leave()
    if held is None:  # this thread's pre-hook refused the step before it began
        return
    cache, temporary = held
    cache.end_step(_step_shape(args, kwargs)[0][1], done=output is not None)
    if temporary:
        cache.release()
