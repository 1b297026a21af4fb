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

from ..engine_core import Internal

__all__ = ["INTERNALS", "MLA", "REGISTRY", "CPU_MLA_MODULE"]

MLA = "vllm.model_executor.layers.attention.mla_attention"
REGISTRY = "vllm.v1.attention.backends.registry"
CPU_MLA_MODULE = "vllm.v1.attention.backends.mla.cpu_mla"
_BACKEND = "vllm.v1.attention.backend"

#: the table: (owner, attribute, what the adapter does with it)
INTERNALS: tuple[Internal, ...] = (
    # registration (the plugin, at start-up)
    Internal(f"{REGISTRY}:register_backend", "", "registers its backend class for the members below"),
    Internal(f"{REGISTRY}:AttentionBackendEnum", "CUSTOM", "overrides it (CUDA: --attention-backend CUSTOM)"),
    Internal(f"{REGISTRY}:AttentionBackendEnum", "CPU_MLA", "overrides it on the CPU platform, whose selector "
             "answers CPU_MLA for every MLA model"),
    Internal("vllm.platforms:current_platform", "is_cpu", "reads the platform at start-up"),
    Internal("vllm.platforms:current_platform", "fp8_dtype", "reads the platform's fp8 type at start-up"),
    Internal("vllm.config:get_current_vllm_config", "", "reads the configuration in each impl at start-up"),
    Internal("vllm.config:get_current_vllm_config_or_none", "", "reads the configuration in vLLM's "
             "backend validation (supports_* hooks)"),
    # the classes it builds on
    Internal(f"{MLA}:MLACommonBackend", "get_supported_head_sizes", "subclasses MLACommonBackend; reads the row "
             "widths vLLM's MLA metadata takes at start-up"),
    Internal(f"{MLA}:MLACommonMetadataBuilder", "build", "overrides it: vLLM's build, then the decode part's "
             "BatchMetadata and plan, once per step"),
    Internal(f"{MLA}:MLACommonMetadataBuilder", "get_cudagraph_support", "overrides it (the chosen backend's "
             "cuda_graphs flag)"),
    Internal(f"{MLA}:MLACommonImpl", "forward_mqa", "overrides it: every decode call runs the selected "
             "backend's forward_mqa"),
    Internal(f"{MLA}:MLACommonImpl", "do_kv_cache_update", "overrides it: vLLM's write (fp8 rows on the CPU "
             "written by the adapter)"),
    Internal(f"{CPU_MLA_MODULE}:CPUMLAImpl", "do_kv_cache_update", "subclasses CPUMLAImpl on the CPU (its SDPA "
             "prefill and cache write)"),
    Internal(f"{MLA}:MLACommonDecodeMetadata", "block_table", "reads the decode rows' page table per step"),
    Internal(f"{MLA}:MLACommonDecodeMetadata", "seq_lens", "reads the decode rows' device lengths per step"),
    Internal(f"{MLA}:MLACommonDecodeMetadata", "dcp_tot_seq_lens", "reads it per step (set under decode context "
             "parallelism)"),
    Internal(f"{_BACKEND}:CommonAttentionMetadata", "seq_lens_cpu_upper_bound", "reads the host lengths per step"),
    Internal(f"{_BACKEND}:CommonAttentionMetadata", "dcp_local_seq_lens_cpu_upper_bound", "reads this rank's "
             "host lengths per step under decode context parallelism"),
    Internal(f"{_BACKEND}:AttentionCGSupport", "UNIFORM_SINGLE_TOKEN_DECODE", "answers it when the backend "
             "declares CUDA graphs"),
    Internal(f"{_BACKEND}:MultipleOf", "", "declares kernel block sizes as a multiple"),
    # the configuration (the metadata builder, at start-up)
    Internal("config", "compilation_config.static_forward_context", "finds each MLA layer by name"),
    Internal("config", "cache_config.cache_dtype", "reads the cache dtype"),
    Internal("config", "model_config.model", "names the model in the start-up line"),
    Internal("config", "parallel_config.decode_context_parallel_size", "reads the DCP group size"),
    # each MLA layer (the metadata builder, at start-up) and its impl (the impl, at start-up)
    Internal("layer", "_k_scale_float", "reads the host fp8 k_scale an fp8 cache is written and read with, per "
             "decode call (a float compare; the wrapper is re-made only when it changes)"),
    Internal("layer", "impl", "checks that every layer's impl runs the builder's configured backend"),
    Internal("impl", "num_heads", "selects for this rank's query heads at start-up"),
    Internal("impl", "scale", "checks vLLM's softmax scale against the model config's at start-up"),
    Internal("impl", "kv_lora_rank", "splits queries and wraps caches"),
    Internal("impl", "kv_cache_dtype", "reads the cache format at start-up"),
    Internal("impl", "dcp_world_size", "reads the DCP group size at start-up"),
    Internal("impl", "need_to_return_lse_for_decode", "sets it (an LSE only under DCP)"),
    Internal("impl", "can_return_lse_for_decode", "sets it from the backend's returns_lse"),
    Internal("impl", "supports_quant_query_input", "sets it False (queries come in the model dtype)"),
)
