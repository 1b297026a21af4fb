"""The ``mla-backends demo`` section that runs transformers' own ``generate()`` both ways.

A tiny random ``DeepseekV3ForCausalLM`` (2 layers, one of them MoE, YaRN, a query latent) generates greedily
for a batch of left-padded prompts, first as transformers runs it, then after
:func:`~mla_backends.integrations.transformers.patch_model`; the section prints how many tokens agree and the
speed ratio of the two ``generate`` calls. Skipped (with a line saying so) when transformers is missing.
"""

from __future__ import annotations

import argparse
import time


def _tiny_model(seed: int):
    import torch
    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=48, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=2048, pad_token_id=0, bos_token_id=None,
        eos_token_id=None, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "mscale": 1.0, "mscale_all_dim": 1.0,
                                            "original_max_position_embeddings": 512, "beta_fast": 32,
                                            "beta_slow": 1})
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.05)
    return model


def generate_demo(args: argparse.Namespace) -> int:
    """Greedy ``generate()`` of a tiny DeepSeek-V3 unpatched and patched: agreement and speed ratio."""
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        print("\ntransformers generate() section skipped: transformers is not installed (pip install "
              "'mla-backends[transformers]')")
        return 0
    from ..integrations.transformers import patch_model

    model = _tiny_model(args.seed)
    lengths, new = [160, 96, 128], 16
    S = max(lengths)
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.zeros(len(lengths), S, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, S - n:] = torch.randint(1, 512, (n,), generator=g)
        mask[b, S - n:] = 1
    kw = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)

    def timed():
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, **kw)
        return out[:, S:], time.perf_counter() - t0

    ref, t_ref = timed()
    backend = getattr(args, "backend_cls", None)
    patch_model(model, backend=backend)
    got, t_got = timed()
    agree = (ref == got).float().mean().item()
    print(f"\ntransformers generate(), tiny random DeepseekV3ForCausalLM (2 layers, MoE, YaRN, q_lora "
          f"{model.config.q_lora_rank}), fp32, left-padded prompts {lengths}, {new} greedy tokens each")
    print(f"  unpatched: {t_ref:.2f} s   patched (mla-backends, {patch_model.__name__}): {t_got:.2f} s   "
          f"speed ratio {t_ref / t_got:.1f}x")
    print(f"  tokens agreeing: {agree * 100:.1f}% of {ref.numel()}   {'MATCH' if agree == 1.0 else 'MISMATCH'}")
    return 0 if agree == 1.0 else 1
