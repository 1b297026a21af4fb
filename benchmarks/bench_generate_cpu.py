"""transformers' ``generate()`` with and without ``patch_model``, on the CPU, reported as ratios.

A DeepSeek-V2-Lite-shaped ``DeepseekV2ForCausalLM`` (16 heads, 512/64/128/128, no query latent, hidden 2048,
vocabulary 1,024, intermediate 1,024) cut to 2 dense layers, random weights, fp32, ``attn_implementation="sdpa"``
(transformers' default). A batch of ``--batch`` prompts of ``--prompt`` tokens is generated greedily for
``--new-tokens`` tokens twice in one run: by the unpatched model (its cache holds the latent and
``kv_b_proj`` re-expands it on every step) and by the same model after ``patch_model`` (absorbed decode over
a paged latent cache, REF_TORCH). Decode tokens/s is timed between the first and the last decode step (a
logits processor stamps every step), so the prefill is left out; the attention-only ratio sums the attention
modules' forward times over the decode steps. Target: >= 20x for the whole decode step.

Usage: ``python benchmarks/bench_generate_cpu.py [--batch 4] [--prompt 2048] [--new-tokens 16] [--json out]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def build_model(layers: int, seed: int = 0):
    import transformers

    cfg = transformers.DeepseekV2Config(
        vocab_size=1024, hidden_size=2048, intermediate_size=1024, moe_intermediate_size=1024,
        num_hidden_layers=layers, first_k_dense_replace=layers, num_attention_heads=16, num_key_value_heads=16,
        kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        max_position_embeddings=8192, pad_token_id=0, bos_token_id=None, eos_token_id=None,
        attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = transformers.DeepseekV2ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.02)
    return model


class StepClock:
    """A logits processor that stamps each generation step (leaves the scores alone)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores


class AttentionClock:
    """Forward hooks summing the attention modules' time over single-token (decode) calls."""

    def __init__(self, model) -> None:
        self.total = 0.0
        self.handles = []
        for layer in model.model.layers:
            self.handles.append(layer.self_attn.register_forward_pre_hook(self._start, with_kwargs=True))
            self.handles.append(layer.self_attn.register_forward_hook(self._stop, with_kwargs=True))

    def _start(self, module, args, kwargs) -> None:
        self._t0 = time.perf_counter()

    def _stop(self, module, args, kwargs, output) -> None:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if hidden is not None and hidden.shape[1] == 1:
            self.total += time.perf_counter() - self._t0

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def run(model, ids: torch.Tensor, new_tokens: int) -> dict[str, object]:
    from transformers import LogitsProcessorList

    clock, attn = StepClock(), AttentionClock(model)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             logits_processor=LogitsProcessorList([clock]), pad_token_id=0)
    attn.remove()
    steps = len(clock.stamps) - 1  # decode steps between the first and the last stamp
    decode_s = clock.stamps[-1] - clock.stamps[0]
    return {"tokens_per_s": ids.shape[0] * steps / decode_s, "decode_s": decode_s,
            "attention_s": attn.total, "sequences": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args(argv)
    if args.new_tokens < 3:
        ap.error(f"--new-tokens: got {args.new_tokens}; supported >= 3")
    from mla_backends.integrations.transformers import patch_model

    model = build_model(args.layers)
    ids = torch.randint(1, 1024, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    base = run(model, ids, args.new_tokens)
    patch_model(model, backend="REF_TORCH")
    patched = run(model, ids, args.new_tokens)
    same = bool(torch.equal(base["sequences"], patched["sequences"]))
    res = {
        "batch": args.batch, "prompt": args.prompt, "new_tokens": args.new_tokens, "layers": args.layers,
        "threads": torch.get_num_threads(), "transformers_tokens_per_s": base["tokens_per_s"],
        "patched_tokens_per_s": patched["tokens_per_s"],
        "decode_ratio": patched["tokens_per_s"] / base["tokens_per_s"],
        "attention_ratio": base["attention_s"] / patched["attention_s"], "identical_tokens": same,
    }
    print(f"DeepSeek-V2-Lite-shaped, {args.layers} dense layers, fp32, batch {args.batch}, prompts {args.prompt}, "
          f"{args.new_tokens} new tokens, {res['threads']} threads")
    print(f"  transformers generate():        {res['transformers_tokens_per_s']:8.1f} decode tokens/s")
    print(f"  patched (mla-backends):         {res['patched_tokens_per_s']:8.1f} decode tokens/s")
    print(f"  decode step ratio: {res['decode_ratio']:.1f}x (target >= 20x); attention only: "
          f"{res['attention_ratio']:.1f}x; tokens identical: {same}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(res, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
