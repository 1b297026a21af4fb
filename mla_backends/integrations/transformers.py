"""transformers' own ``generate()`` on mla-backends: :func:`patch_model` / :func:`unpatch_model`.

::

    from mla_backends.integrations.transformers import patch_model, unpatch_model
    model = patch_model(model, backend=None, kv_cache_dtype="auto", block_size=None)  # the same model
    model.generate(input_ids, attention_mask=mask, max_new_tokens=64, do_sample=False)
    unpatch_model(model)                                                              # the original modules

Every ``DeepseekV2Attention`` / ``DeepseekV3Attention`` of the model is replaced by a
:class:`PatchedMLAAttention` holding an :class:`~mla_backends.layer.MLAAttention` loaded with the module's own
weights (``kv_b_proj`` folded once). The latent rows live in a paged cache per layer, owned by a
:class:`MLAGenerationCache` (a transformers ``Cache``): ``generate`` is wrapped so that each call gets a new
one, sized at its first step for the call's longest sequence (prompt + ``max_new_tokens``, so decode steps
never reallocate or copy it), grown only if that bound is exceeded, and released when the call returns.

How a step maps onto :class:`~mla_backends.metadata.BatchMetadata`: a forward pre-hook on the decoder stack
reads the 2-D ``attention_mask``; request ``b``'s new real (unmasked) tokens are its query, its real tokens
cached so far its context, and padding is neither written nor attended. RoPE positions are the model's own
``position_ids`` (left padding shifts them as transformers does). Decode steps (one token) run absorbed
through the backend's ``forward_mqa``; prefills go through the shared ``forward_mha``. The outputs of padding
positions are zeros (transformers' are never used either).

Supported transformers versions: the ``transformers`` extra of ``pyproject.toml`` (tested on 5.17 and 5.24).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from transformers.cache_utils import Cache

from ..layer import MLAAttention
from ..metadata import BatchMetadata
from ..validation import require_int

__all__ = ["patch_model", "unpatch_model", "is_patched", "PatchedMLAAttention", "MLAGenerationCache",
           "UnsupportedGenerationError", "DEFAULT_BLOCK_SIZE", "MAX_RESERVE_TOKENS"]

#: page size of the managed latent caches when ``patch_model(block_size=None)``
DEFAULT_BLOCK_SIZE = 64
#: most tokens per request a call's pool is sized for up front (longer calls grow it by doubling), so that a
#: large ``max_new_tokens`` that ends early at an EOS does not hold memory it never uses
MAX_RESERVE_TOKENS = 32768
_ATTENTION_CLASSES = ("DeepseekV2Attention", "DeepseekV3Attention")
_STATE_ATTR = "_mla_backends_patch"


class UnsupportedGenerationError(NotImplementedError):
    """A ``generate`` feature a patched model does not run (beam search, assisted decoding ...)."""


class MLAGenerationCache(Cache):
    """The latent caches of one patched ``generate`` call (or one plain forward), one per layer.

    transformers sees the padded sequence length (:meth:`get_seq_length`); per request it keeps the count of
    real tokens cached, a page list, and the :class:`BatchMetadata` of the step in flight. Pages are handed
    out in order from one pool per layer. ``reserve_tokens`` (tokens per request the call can reach, None:
    unknown) sizes the pool at the first step to ``requests x ceil(reserve_tokens / block_size)`` pages (at
    most the layers' ``max_model_len`` and :data:`MAX_RESERVE_TOKENS` tokens a request), so the pool is
    allocated once; past that (or without a bound) it doubles, copying its rows.
    """

    is_compileable = False

    def __init__(self, layers: dict[int, MLAAttention], *, block_size: int, kv_cache_dtype: str,
                 reserve_tokens: int | None = None) -> None:
        super().__init__(layers=[])
        self.mla_layers = layers
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.reserve_tokens = None if reserve_tokens is None else require_int("reserve_tokens", reserve_tokens,
                                                                               minimum=1)
        self.caches: dict[int, Any] = {}  # layer index -> LatentKVCache
        self.num_blocks = 0
        self.pages: list[list[int]] = []
        self.context: list[int] = []
        self.seen = 0  # padded tokens processed (what transformers counts)
        #: (metadata, real-token indices or None when every token of the step is real)
        self.step: tuple[BatchMetadata, torch.Tensor | None] | None = None
        self.released = False
        self.allocations = 0  # pools allocated (one per layer each time the pool is sized)

    # ---- what transformers asks ---------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: Any, layer_idx: int = 0) -> tuple[int, int]:
        q = query_length.shape[-1] if isinstance(query_length, torch.Tensor) else int(query_length)
        return self.seen + q, 0

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * max(1, len(self.mla_layers))

    def _unsupported(self, what: str) -> None:
        raise UnsupportedGenerationError(f"{what}: not supported by mla-backends' patched models "
                                         "(their latent cache cannot be reordered, cropped or copied)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._unsupported("beam search (reorder_cache)")

    def crop(self, max_length: int) -> None:
        self._unsupported("cropping the cache (assisted or contrastive decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unsupported("expanding a filled cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._unsupported("selecting requests of a filled cache")

    # ---- steps ---------------------------------------------------------------------------------------------
    def begin_step(self, new_mask: torch.Tensor) -> None:
        """Start a step whose new tokens are ``new_mask [B, S]`` (True: a real token, False: padding)."""
        if self.released:
            raise RuntimeError("MLAGenerationCache: used after its generate call returned; start a new call")
        B = new_mask.shape[0]
        first_step = not self.pages
        if first_step:
            self.pages = [[] for _ in range(B)]
            self.context = [0] * B
        elif B != len(self.pages):
            raise ValueError(f"input_ids: got a batch of {B}; supported the cache's {len(self.pages)} requests")
        q = [int(v) for v in new_mask.sum(1).tolist()]
        bs = self.block_size
        for b in range(B):
            need = -(-(self.context[b] + q[b]) // bs) - len(self.pages[b])
            for _ in range(need):
                self.pages[b].append(self._next_page())
        width = max(1, max(len(p) for p in self.pages))
        table = [p + [-1] * (width - len(p)) for p in self.pages]
        first = next(iter(self.mla_layers.values()))
        reserve = 0
        if first_step and self.reserve_tokens is not None:
            tokens = min(self.reserve_tokens, first.max_model_len, MAX_RESERVE_TOKENS)
            reserve = B * -(-tokens // bs)
        self._grow(reserve)
        meta = BatchMetadata.build(q, self.context, table, bs, decode_threshold=first.decode_threshold,
                                   num_blocks=self.num_blocks, device=first.weight_device)
        real = None  # every token real (all decode steps, unpadded prefills): no gather / scatter needed
        if sum(q) != new_mask.numel():
            real = new_mask.reshape(-1).nonzero().squeeze(1).to(first.weight_device)
        self.step = (meta, real)
        self._q = q

    def end_step(self, seq_len: int) -> None:
        """The step's rows are in: count them (``seq_len``: padded tokens of the step)."""
        if self.step is not None:
            self.context = [c + q for c, q in zip(self.context, self._q, strict=True)]
            self.seen += seq_len
        self.step = None

    def _next_page(self) -> int:
        used = sum(len(p) for p in self.pages)
        return used

    def _grow(self, reserve: int = 0) -> None:
        """Make the pool hold every page handed out and at least ``reserve`` pages (doubling when a pool
        exists, rows copied) and allocate missing layers."""
        used = sum(len(p) for p in self.pages)
        if max(used, reserve) > self.num_blocks:
            new = max(used, reserve, 2 * self.num_blocks, 1)
            for idx, old in list(self.caches.items()):
                fresh = self.mla_layers[idx].allocate_cache(new, self.block_size, self.kv_cache_dtype)
                fresh.data[: old.num_blocks].copy_(old.data)
                self.caches[idx] = fresh
                self.allocations += 1
            self.num_blocks = new
        for idx, layer in self.mla_layers.items():
            if idx not in self.caches:
                self.caches[idx] = layer.allocate_cache(max(self.num_blocks, 1), self.block_size,
                                                        self.kv_cache_dtype)
                self.allocations += 1
        self.num_blocks = max(self.num_blocks, 1)

    def release(self) -> None:
        """Drop every page (the generate call is over)."""
        self.caches.clear()
        self.pages, self.context, self.step, self.num_blocks = [], [], None, 0
        self.released = True

    def __repr__(self) -> str:
        return (f"MLAGenerationCache(layers={len(self.mla_layers)}, requests={len(self.pages)}, "
                f"seen={self.seen}, pages={self.num_blocks} x {self.block_size})")


class PatchedMLAAttention(torch.nn.Module):
    """Stands in for one transformers DeepSeek attention module; ``mla`` does the work.

    ``forward(hidden_states [B, S, hidden], position_embeddings, attention_mask, ..., position_ids [B|1, S])``
    returns ``([B, S, hidden], None)`` like transformers' module (no attention weights).
    """

    def __init__(self, mla: MLAAttention, state: _PatchState) -> None:
        super().__init__()
        self.mla = mla
        self.layer_idx = mla.layer_idx
        self._state = state

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Any = None, attention_mask: Any = None,
                *args: Any, position_ids: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        cache = self._state.active
        if cache is None or cache.step is None:
            raise RuntimeError("PatchedMLAAttention: called outside the patched model's forward; call the model")
        meta, real = cache.step
        B, S, hid = hidden_states.shape
        x = hidden_states.reshape(B * S, hid)
        x = x if real is None else x.index_select(0, real)
        positions = None
        if position_ids is not None:
            pos = position_ids.reshape(-1, position_ids.shape[-1])[:, -S:].expand(B, S).reshape(-1)
            positions = (pos if real is None else pos.index_select(0, real.to(pos.device))).to(x.device)
        y = self.mla(x, positions, cache.caches[self.layer_idx], meta)
        if real is None:
            return y.view(B, S, hid), None
        out = hidden_states.new_zeros(B * S, hid)
        out.index_copy_(0, real, y)
        return out.view(B, S, hid), None


class _PatchState:
    """What :func:`patch_model` keeps on the model: originals, hooks, the layers and the active cache."""

    def __init__(self, layers: dict[int, MLAAttention], block_size: int, kv_cache_dtype: str,
                 cache_kw: str) -> None:
        self.layers = layers
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.cache_kw = cache_kw
        self.originals: dict[str, torch.nn.Module] = {}
        self.hooks: list[Any] = []
        self.active: MLAGenerationCache | None = None
        self.temporary = False

    def new_cache(self, reserve_tokens: int | None = None) -> MLAGenerationCache:
        return MLAGenerationCache(self.layers, block_size=self.block_size, kv_cache_dtype=self.kv_cache_dtype,
                                  reserve_tokens=reserve_tokens)


def _decoder_stack(model: torch.nn.Module) -> torch.nn.Module:
    """The module that runs the decoder layers (``model.model`` of a ``...ForCausalLM``)."""
    for cand in (getattr(model, "model", None), model):
        if isinstance(cand, torch.nn.Module) and isinstance(getattr(cand, "layers", None), torch.nn.ModuleList):
            return cand
    raise TypeError(f"model: got {type(model).__name__} without a decoder stack (.model.layers); supported "
                    "transformers' DeepseekV2ForCausalLM / DeepseekV3ForCausalLM or their base models")


def _pre_hook(state: _PatchState, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    shape = ids.shape[:2] if ids is not None else embeds.shape[:2]
    device = (ids if ids is not None else embeds).device
    cache = kwargs.get(state.cache_kw)
    if cache is not None and not isinstance(cache, MLAGenerationCache):
        raise TypeError(f"{state.cache_kw}: got {type(cache).__name__}; a patched model keeps its latent rows in "
                        "an MLAGenerationCache (model.generate makes one per call); pass none for a plain forward")
    mask = kwargs.get("attention_mask")
    if mask is None:
        new = torch.ones(shape, dtype=torch.bool, device=device)
    elif isinstance(mask, torch.Tensor) and mask.dim() == 2:
        new = mask[:, -shape[1]:].to(torch.bool)
    else:
        raise UnsupportedGenerationError(f"attention_mask: got {getattr(mask, 'shape', type(mask).__name__)}; "
                                         "patched models take a 2-D [batch, length] padding mask only")
    state.temporary = cache is None
    state.active = state.new_cache() if cache is None else cache
    state.active.begin_step(new)


def _post_hook(state: _PatchState, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    ids = kwargs.get("input_ids", args[0] if args else None)
    seq = (ids if ids is not None else kwargs["inputs_embeds"]).shape[1]
    if state.active is not None:
        state.active.end_step(seq)
        if state.temporary:
            state.active.release()
    state.active, state.temporary = None, False


_UNSUPPORTED = (  # (generate argument, value meaning "off", feature named in the error)
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


def _check_generate_kwargs(model: torch.nn.Module, kwargs: dict) -> None:
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    for name, off, feature in _UNSUPPORTED:
        value = kwargs[name] if name in kwargs else getattr(config, name, off)
        if value is not None and value != off and not (off == 1 and value is None):
            raise UnsupportedGenerationError(f"{name}: got {value!r}; {feature} is not supported on a model "
                                             "patched by mla-backends (unpatch_model(model) to use it)")


def _longest_sequence(model: torch.nn.Module, args: tuple, kwargs: dict) -> int | None:
    """Tokens per request a ``generate(*args, **kwargs)`` call can reach (prompt + ``max_new_tokens``, else
    ``max_length``), or None when it cannot be told before the call."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    prompt = kwargs.get("input_ids", args[0] if args else None)
    if prompt is None:
        prompt = kwargs.get("inputs_embeds")
    new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    if isinstance(prompt, torch.Tensor) and prompt.dim() >= 2 and isinstance(new, int) and new >= 0:
        return max(1, prompt.shape[1] + new)
    longest = kwargs.get("max_length", getattr(config, "max_length", None))
    return longest if isinstance(longest, int) and longest >= 1 else None


def _wrap_generate(model: torch.nn.Module, state: _PatchState) -> Any:
    original = type(model).generate

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        _check_generate_kwargs(model, kwargs)
        given = kwargs.get(state.cache_kw)
        if given is not None and not isinstance(given, MLAGenerationCache):
            raise TypeError(f"{state.cache_kw}: got {type(given).__name__}; a patched model makes its own "
                            "MLAGenerationCache per generate call (pass none)")
        cache = given if given is not None else state.new_cache(_longest_sequence(model, args, kwargs))
        kwargs[state.cache_kw] = cache
        try:
            return original(model, *args, **kwargs)
        finally:
            if given is None:
                cache.release()

    return generate


def patch_model(model: torch.nn.Module, *, backend: Any = None, kv_cache_dtype: str = "auto",
                block_size: int | None = None) -> torch.nn.Module:
    """Run every DeepSeek-V2/V3 attention module of ``model`` on :class:`MLAAttention`; returns ``model``.

    Args:
        model: a transformers ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` (or any model whose
            decoder layers hold ``DeepseekV2Attention`` / ``DeepseekV3Attention`` modules).
        backend: backend name or class for ``forward_mqa``; None = the selector's choice for the device.
        kv_cache_dtype: latent cache dtype (``"auto"``: the model dtype; ``"fp8_e4m3"`` where the backend can).
        block_size: tokens per cache page (default :data:`DEFAULT_BLOCK_SIZE`).

    The layers take the modules' weights, dtype and device as they are now. Raises TypeError for a model
    without such modules and ValueError for one already patched.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: got {type(model).__name__}; supported a transformers DeepSeek model")
    if is_patched(model):
        raise ValueError("model: got a model already patched by mla-backends; call unpatch_model(model) first")
    if not isinstance(kv_cache_dtype, str):
        raise TypeError(f"kv_cache_dtype: got {type(kv_cache_dtype).__name__}; supported a name such as 'auto'")
    bs = DEFAULT_BLOCK_SIZE if block_size is None else require_int("block_size", block_size, minimum=1)
    stack = _decoder_stack(model)
    found = [(name, mod) for name, mod in model.named_modules() if type(mod).__name__ in _ATTENTION_CLASSES]
    if not found:
        raise TypeError(f"model: got {type(model).__name__} without DeepseekV2Attention/DeepseekV3Attention "
                        "modules; supported transformers' DeepSeek-V2/V3 models")
    fwd = inspect.signature(stack.forward).parameters
    state = _PatchState({}, bs, kv_cache_dtype, "cache" if "cache" in fwd else "past_key_values")
    replacements = []
    for name, mod in found:
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
    state.hooks.append(stack.register_forward_pre_hook(functools.partial(_pre_hook, state), with_kwargs=True))
    state.hooks.append(stack.register_forward_hook(functools.partial(_post_hook, state), with_kwargs=True))
    model.__dict__[_STATE_ATTR] = state
    if callable(getattr(type(model), "generate", None)):  # a bare decoder stack has no generate() to wrap
        model.__dict__["generate"] = _wrap_generate(model, state)
    return model


def is_patched(model: torch.nn.Module) -> bool:
    """Whether :func:`patch_model` patched ``model`` (and :func:`unpatch_model` has not undone it)."""
    return _STATE_ATTR in getattr(model, "__dict__", {})


def unpatch_model(model: torch.nn.Module) -> torch.nn.Module:
    """Put the original attention modules, ``forward`` hooks and ``generate`` back; returns ``model``."""
    if not is_patched(model):
        raise ValueError(f"model: got a {type(model).__name__} that patch_model did not patch")
    state: _PatchState = model.__dict__.pop(_STATE_ATTR)
    model.__dict__.pop("generate", None)
    for handle in state.hooks:
        handle.remove()
    for name, mod in state.originals.items():
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, mod)
    return model
