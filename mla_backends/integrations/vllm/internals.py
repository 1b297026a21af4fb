"""Every vLLM internal the vLLM adapter touches, in one table (data; imports no vLLM).

Each row names where the thing lives, what it is called there and what the adapter does with it. The rows are
checked at start-up with :func:`~..engine_core.check_internals`: the module rows when the plugin registers its
backend (:func:`.plugin.register_backends`), the ``impl`` rows in each layer's impl, the ``config`` and ``layer``
rows in the metadata builder (every MLA layer of ``layer_names``). A vLLM that renamed or dropped one refuses to
start, naming it; the hot path then reads them plainly, never with a default.

Not used, on purpose: vLLM's ``MLACommonMetadataBuilder._build_decode`` hook. It is handed the decode rows'
device lengths but not vLLM's host copy of them (``CommonAttentionMetadata.seq_lens_cpu_upper_bound``), which
the step's ``BatchMetadata`` needs (REF_TORCH sizes its work from host lengths); reading the device lengths there
would cost a device-to-host sync per step on a GPU. So the adapter overrides ``build`` (vLLM's own ``build`` runs
first) and adds the decode part's metadata from ``common_attn_metadata``.
"""

from __future__ import annotations

from ..engine_core import Internal, internals_table

__all__ = ["INTERNALS", "MLA", "REGISTRY", "CPU_MLA_MODULE"]

MLA = "vllm.model_executor.layers.attention.mla_attention"
REGISTRY = "vllm.v1.attention.backends.registry"
CPU_MLA_MODULE = "vllm.v1.attention.backends.mla.cpu_mla"
_BACKEND = "vllm.v1.attention.backend"

#: the table: owner -> {attribute: what the adapter does with it}
INTERNALS: tuple[Internal, ...] = internals_table({
    f"{REGISTRY}:register_backend": {
        "": "registers its backend class for the members below",
    },
    f"{REGISTRY}:AttentionBackendEnum": {
        "CUSTOM": "overrides it (CUDA: --attention-backend CUSTOM)",
        "CPU_MLA": "overrides it on the CPU platform, whose selector answers CPU_MLA for every MLA model",
    },
    "vllm.platforms:current_platform": {
        "is_cpu": "reads the platform at start-up",
        "fp8_dtype": "reads the platform's fp8 type at start-up",
    },
    "vllm.config:get_current_vllm_config": {
        "": "reads the configuration in each impl at start-up",
    },
    "vllm.config:get_current_vllm_config_or_none": {
        "": "reads the configuration in vLLM's backend validation (supports_* hooks)",
    },
    f"{MLA}:MLACommonBackend": {
        "get_supported_head_sizes": ("subclasses MLACommonBackend; reads the row widths vLLM's MLA metadata takes at "
            "start-up"),
    },
    f"{MLA}:MLACommonMetadataBuilder": {
        "build": "overrides it: vLLM's build, then the decode part's BatchMetadata and plan, once per step",
        "get_cudagraph_support": "overrides it (the chosen backend's cuda_graphs flag)",
    },
    f"{MLA}:MLACommonImpl": {
        "forward_mqa": "overrides it: every decode call runs the selected backend's forward_mqa",
        "do_kv_cache_update": "overrides it: vLLM's write (fp8 rows on the CPU written by the adapter)",
    },
    f"{CPU_MLA_MODULE}:CPUMLAImpl": {
        "do_kv_cache_update": "subclasses CPUMLAImpl on the CPU (its SDPA prefill and cache write)",
    },
    f"{MLA}:MLACommonDecodeMetadata": {
        "block_table": "reads the decode rows' page table per step",
        "seq_lens": "reads the decode rows' device lengths per step",
        "dcp_tot_seq_lens": "reads it per step (set under decode context parallelism)",
    },
    f"{_BACKEND}:CommonAttentionMetadata": {
        "seq_lens_cpu_upper_bound": "reads the host lengths per step",
        "dcp_local_seq_lens_cpu_upper_bound": ("reads this rank's host lengths per step under decode context "
            "parallelism"),
    },
    f"{_BACKEND}:AttentionCGSupport": {
        "UNIFORM_SINGLE_TOKEN_DECODE": "answers it when the backend declares CUDA graphs",
    },
    f"{_BACKEND}:MultipleOf": {
        "": "declares kernel block sizes as a multiple",
    },
    "config": {
        "compilation_config.static_forward_context": "finds each MLA layer by name",
        "cache_config.cache_dtype": "reads the cache dtype",
        "model_config.model": "names the model in the start-up line",
        "parallel_config.decode_context_parallel_size": "reads the DCP group size",
    },
    "layer": {
        "_k_scale_float": ("reads the host fp8 k_scale an fp8 cache is written and read with, per decode call (a "
            "float compare; the wrapper is re-made only when it changes)"),
        "impl": "checks that every layer's impl runs the builder's configured backend",
    },
    "impl": {
        "num_heads": "selects for this rank's query heads at start-up",
        "scale": "checks vLLM's softmax scale against the model config's at start-up",
        "kv_lora_rank": "splits queries and wraps caches",
        "kv_cache_dtype": "reads the cache format at start-up",
        "dcp_world_size": "reads the DCP group size at start-up",
        "need_to_return_lse_for_decode": "sets it (an LSE only under DCP)",
        "can_return_lse_for_decode": "sets it from the backend's returns_lse",
        "supports_quant_query_input": "sets it False (queries come in the model dtype)",
    },
})
