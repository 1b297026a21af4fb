"""How the indexer key storage of a DeepSeek-V3.2 layer changes its top-k and output, against transformers.

``MLAAttention.allocate_cache(indexer_storage=...)`` stores the indexer keys as fp8 e4m3 (the default, 132 bytes a
token, as vLLM and SGLang store them) or in the layer's own dtype (``"auto"``). transformers'
``DeepseekV32Attention`` keeps its indexer keys unquantised. This script runs one random tiny V3.2 layer both
ways over a prefill and then one-token decode steps, and reports, per storage and layer dtype:

- tokens whose top-k differs from transformers' (as sets of visible positions);
- the output's relative error against transformers run in float64 on the whole sequence, per token
  (``max |y - y_ref| / max |y_ref|``): tokens past 1e-3, median and maximum over tokens.

The weights are random (normal, std 0.2), not a trained checkpoint: scores of trained indexers may be spread
further apart, so fewer ties flip under fp8. Run it from a checkout::

    PYTHONPATH=. .venv/bin/python benchmarks/indexer_storage_agreement.py [--tokens 192] [--prefill 128] [--seeds 3]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from mla_backends import BatchMetadata, MLAAttention, plan_step


def v32_config(topk: int):
    from transformers import DeepseekV32Config

    cfg = DeepseekV32Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, index_n_heads=16, index_head_dim=128,
        index_topk=topk, num_hidden_layers=1, max_position_embeddings=1024, vocab_size=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg._attn_implementation = "eager"
    return cfg


@torch.no_grad()
def transformers_reference(cfg, seed: int, x: torch.Tensor):
    """transformers' layer in float64 on the whole sequence: ``(output [L, hidden], top-k [L, topk], weights)``."""
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as tmod

    torch.manual_seed(seed)
    attn = tmod.DeepseekV32Attention(cfg, layer_idx=0).double().eval()
    for name, p in attn.named_parameters():
        p.normal_(0.0, 0.2)
        if "layernorm" in name or "k_norm.weight" in name:
            p.add_(1.0)
    seen = []
    hook = attn.indexer.register_forward_hook(lambda mod, args, out: seen.append(out))
    L = x.shape[0]
    cos, sin = tmod.DeepseekV32RotaryEmbedding(cfg)(x[None], torch.arange(L)[None])
    mask = torch.full((L, L), float("-inf"), dtype=x.dtype).triu(1)[None, None]
    y, _ = attn(x[None], (cos, sin), mask)
    hook.remove()
    return y[0], seen[0][0], attn.state_dict()


@torch.no_grad()
def ours(cfg, weights, x: torch.Tensor, prefill: int, dtype: torch.dtype, storage: str):
    """Our layer: a prefill of ``prefill`` tokens, then one token a step: ``(output [L, hidden], top-k)``."""
    layer = MLAAttention.from_hf_config(cfg, dtype=dtype)
    layer.load_hf_state_dict({k: v.to(dtype) for k, v in weights.items()})
    L, bs = x.shape[0], 16
    pages = -(-L // bs)
    cache = layer.allocate_cache(pages + 1, bs, indexer_storage=storage)
    table = [list(range(pages))]
    outs, topks, done = [], [], 0
    for q in [prefill] + [1] * (L - prefill):
        meta = BatchMetadata.build([q], [done], table, bs, num_blocks=cache.num_blocks)
        y = layer(x[done:done + q].to(dtype), torch.arange(done, done + q), cache, plan_step(meta, [layer]))
        outs.append(y.double())
        topks.append(layer.last_topk_indices)
        done += q
    return torch.cat(outs), torch.cat(topks)


#: a token's output counts as off when its relative error passes this
OFF = 1e-3


def compare(ref_y, ref_topk, y, topk) -> tuple[int, list[float]]:
    """``(tokens whose top-k set differs, per-token relative output errors)``."""
    differ = 0
    for t in range(ref_y.shape[0]):
        want = {int(p) for p in ref_topk[t] if 0 <= p <= t}  # transformers also picks masked positions early on
        got = {int(p) for p in topk[t] if p >= 0}
        differ += want != got
    return differ, ((y - ref_y).abs().amax(dim=-1) / ref_y.abs().amax(dim=-1)).tolist()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--tokens", type=int, default=192)
    p.add_argument("--prefill", type=int, default=128)
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = v32_config(args.topk)
    print(f"tokens {args.tokens} (prefill {args.prefill}, then decodes), topk {args.topk}, "
          f"index_n_heads {cfg.index_n_heads}, seeds {args.seeds}")
    print(f"{'layer dtype':<12}{'indexer keys':<18}{'top-k differs':>14}{f'error > {OFF:g}':>15}"
          f"{'median error':>14}{'max error':>11}")
    total = args.tokens * args.seeds
    for dtype in (torch.float64, torch.float32):
        for storage in ("fp8_e4m3", "auto"):
            differ, errors = 0, []
            for seed in range(args.seeds):
                g = torch.Generator().manual_seed(100 + seed)
                x = torch.randn(args.tokens, cfg.hidden_size, generator=g, dtype=torch.float64)
                ref_y, ref_topk, weights = transformers_reference(cfg, seed, x)
                d, e = compare(ref_y, ref_topk, *ours(cfg, weights, x, args.prefill, dtype, storage))
                differ, errors = differ + d, errors + e
            name = str(dtype).removeprefix("torch.")
            shown = storage if storage != "auto" else f"auto ({name})"
            off = sum(e > OFF for e in errors)
            print(f"{name:<12}{shown:<18}{f'{differ}/{total}':>14}{f'{off}/{total}':>15}"
                  f"{statistics.median(errors):>14.1e}{max(errors):>11.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
