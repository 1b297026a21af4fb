"""Every SGLang internal the SGLang adapter touches, in one table (data; imports no SGLang).

Each row names where the thing lives, what it is called there and what the adapter does with it. The rows are
checked at start-up with :func:`~..engine_core.check_internals`: the module rows when the attention backend is
built (once per rank), the ``runner`` and ``pool`` rows on SGLang's model runner, and the
``mla`` and ``radix`` rows on every MLA attention module of the model (its ``attn_mqa`` / ``attn_mha``). An
SGLang that renamed or dropped one refuses to start, naming it; the hot path then reads them plainly, never with
a default.

Not touched, on purpose: SGLang's ``AttentionBackend.forward_metadata`` convention (the adapter keeps its
per-batch state in its own attribute, bound to the batch object by a weak reference), the pool's own
``set_kv_buffer`` (rows are written with the layer's fp8 scale by ``LatentKVCache.write``), and the one-shot
MHA's prefix gather (``mha_one_shot_kv_indices``: the expanded path reads the cached prefix itself).
"""

from __future__ import annotations

from ..engine_core import Internal, internals_table

__all__ = ["INTERNALS", "FORWARD_BATCH", "HANDLER", "METHODS"]

FORWARD_BATCH = "sglang.srt.model_executor.forward_batch_info"
HANDLER = "sglang.srt.models.deepseek_common.attention_backend_handler"
METHODS = "sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods"

#: the table: owner -> {attribute: what the adapter does with it}
INTERNALS: tuple[Internal, ...] = internals_table({
    "sglang.srt.layers.attention.attention_registry:register_attention_backend": {
        "": "registers the backend name mla_backends with its factory",
    },
    "sglang.srt.arg_groups.choices:ATTENTION_BACKEND_CHOICES": {
        "": "adds mla_backends to --attention-backend's choices",
    },
    "sglang.srt.arg_groups.choices:add_attention_backend_choices": {
        "": "adds mla_backends to --attention-backend's choices",
    },
    f"{HANDLER}:AttentionBackendRegistry": {
        "register": "registers the DeepSeek dispatch handler",
    },
    f"{METHODS}:AttnForwardMethod": {
        "MLA": "the handler's answer for absorbed batches",
        "MHA": ("the handler's answer for expanded batches (their q, latent and rope key reach the backend through "
            "prepare_prefill_qkv)"),
    },
    "sglang.srt.model_executor.forward_context:get_attn_backend": {
        "": "finds the backend in the handler, per layer and batch",
    },
    "sglang.srt.plugins.hook_registry:HookRegistry": {
        "register": "refuses start-up for a bad MLA_BACKENDS_SGLANG value (a hook on ServerArgs.check_server_args)",
    },
    "sglang.srt.server_args:ServerArgs": {
        "check_server_args": "the hook's target (it runs once, before SGLang starts its processes)",
    },
    "sglang.srt.layers.attention.base_attn_backend:AttentionBackend": {
        "init_forward_metadata": ("overrides it: the batch's metadata, plan and MHA-or-absorbed decision, once per "
            "batch"),
        "forward_decode": "overrides it",
        "forward_extend": "overrides it",
    },
    f"{FORWARD_BATCH}:ForwardBatch": {
        "forward_mode": "reads the batch's mode per batch",
        "req_pool_indices": "reads the batch's rows of req_to_token",
        "seq_lens": "reads the device lengths of decode batches",
        "seq_lens_cpu": "reads the host lengths of decode batches",
        "extend_prefix_lens_cpu": "reads each extend request's cached prefix",
        "extend_seq_lens_cpu": "reads each extend request's new tokens",
        "out_cache_loc": "reads the new tokens' slots (the batch's writes)",
    },
    f"{FORWARD_BATCH}:ForwardMode": {
        "is_idle": "reads the mode per batch",
        "is_decode": "reads the mode per batch",
        "is_extend_without_speculative": "reads the mode per batch",
    },
    "runner": {
        "device": "selects for it",
        "dtype": "selects for the model dtype",
        "page_size": "selects for the pool's page size and views the pool in pages",
        "model_config.hf_text_config": "reads the model's MLA dims",
        "model_config.model_path": "names the model in the start-up line",
        "model_config.context_len": "bounds the prefill workspace's chunk (default_workspace_rows)",
        "kv_cache_dtype_str": "selects for this runner's resolved cache dtype",
        "spec_algorithm.is_none": ("refuses speculative decoding at start-up (it cannot run on the adapter here: "
            "docs/integrations.md)"),
        "model": "walks it for its MLA attention modules",
        "req_to_token_pool.req_to_token": "reads each batch's page table from it",
        "token_to_kv_pool": "wraps each layer's buffer as a LatentKVCache",
    },
    "pool": {
        "get_key_buffer": "reads the layer's buffer [slots, 1, 576] in each layer call, as SGLang's backends do",
    },
    "mla": {
        "attn_mqa": "the absorbed RadixAttention (its layer id, heads, scale, fp8 k_scale)",
        "attn_mha": "the expanded RadixAttention (its softmax scale)",
        "kv_b_proj": "its weight (or its dense equivalent) up-projects the cached latent in forward_mha",
        "rotary_emb": "ropes q and the new key in prepare_prefill_qkv, as SGLang's own MHA prepare",
        "qk_nope_head_dim": "splits q into its nope and rope parts",
        "num_local_heads": "this rank's query heads",
    },
    "radix": {
        "layer_id": "keys the layer's cache",
        "tp_q_head_num": "this rank's query heads (what the selection is made for)",
        "scaling": "checks SGLang's softmax scale against the model config's, at start-up",
        "k_scale": "the fp8 cache scale as loaded (None: SGLang stores a plain cast, scale 1.0)",
        "k_scale_float": "the host copy of k_scale that rows are written and read with",
    },
})
