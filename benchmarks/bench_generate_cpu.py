"""transformers' ``generate()`` with and without ``patch_model``, on the CPU, reported as ratios.

A DeepSeek-V2-Lite-shaped ``DeepseekV2ForCausalLM`` (16 heads, 512/64/128/128, no query latent, hidden 2048,
vocabulary 1,024, intermediate 1,024) cut to 2 dense layers, random weights, fp32, ``attn_implementation="sdpa"``
(transformers' default). A batch of ``--batch`` prompts of ``--prompt`` tokens is generated greedily for
``--new-tokens`` tokens by the unpatched model (its cache holds the latent and ``kv_b_proj`` re-expands it on
every step) and by the same model after ``patch_model`` (absorbed decode over a paged latent cache, the
selector's backend: CPU_FUSED where it is built, else REF_TORCH; ``--backend`` forces one),
alternating for ``--rounds`` rounds so that both see the same machine; the best round of each is kept. Decode
tokens/s is timed between the first and the last decode step (a logits processor stamps every step), so the
prefill is left out; the attention-only ratio sums the attention modules' forward times over the decode steps.
Target: >= 30x for the whole decode step.

Beside the ratio it prints what bounds it: the patched decode step split into ``forward_mqa``, the rest of
the attention modules and the rest of the model; the bytes one patched decode step must read (every weight
it uses once, the cached latent rows once) over this machine's measured copy bandwidth, which is the
fastest that step can be; and so the largest ratio this machine allows against the measured unpatched
step. The load average and the OpenMP wait policy are recorded: on a machine with more runnable threads
than cores, OpenMP's spinning workers stall each of the decode step's few hundred short kernels
(``OMP_WAIT_POLICY=PASSIVE`` avoids that; see the README).

Usage: ``python benchmarks/bench_generate_cpu.py [--batch 4] [--prompt 2048] [--new-tokens 16] [--rounds 2]
[--threads N] [--json out]``
"""

from __future__ import annotations

import argparse
import json
import os
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


class MqaClock:
    """Times every ``forward_mqa`` call of the patched layers' backends: their classes' method wrapped for the
    run (a layer's configured backend is replaced when its cache is allocated, so an instance patch would miss
    the object the layers call)."""

    def __init__(self, model) -> None:
        self.total = 0.0
        self.classes: dict[type, object] = {}
        for layer in model.model.layers:
            mla = getattr(layer.self_attn, "mla", None)
            cls = type(mla.backend) if mla is not None else None
            if cls is not None and cls not in self.classes:
                self.classes[cls] = cls.__dict__.get("forward_mqa")
                cls.forward_mqa = self._timed(cls.forward_mqa)

    def _timed(self, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t0
        return call

    def remove(self) -> None:
        for cls, own in self.classes.items():
            if own is None:
                del cls.forward_mqa  # the inherited method again
            else:
                cls.forward_mqa = own


def run(model, ids: torch.Tensor, new_tokens: int) -> dict[str, object]:
    """One greedy ``generate`` call: decode tokens/s, decode time, attention and ``forward_mqa`` seconds."""
    from transformers import LogitsProcessorList

    clock, attn, mqa = StepClock(), AttentionClock(model), MqaClock(model)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             logits_processor=LogitsProcessorList([clock]), pad_token_id=0)
    attn.remove()
    mqa.remove()
    steps = len(clock.stamps) - 1  # decode steps between the first and the last stamp
    decode_s = clock.stamps[-1] - clock.stamps[0]
    step_s = sorted(b - a for a, b in zip(clock.stamps, clock.stamps[1:], strict=False))
    return {"tokens_per_s": ids.shape[0] * steps / decode_s, "decode_s": decode_s, "steps": steps,
            "median_step_s": step_s[len(step_s) // 2], "attention_s": attn.total, "forward_mqa_s": mqa.total,
            "sequences": out}


def decode_step_bytes(model, batch: int, seq_len: int) -> int:
    """Bytes one patched decode step must read at least: every weight it uses once (the embedding's rows and
    the unused ``kv_b_proj`` aside) and each layer's cached latent rows once (``batch x seq_len`` of them)."""
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "embed_tokens" not in name and "kv_b_proj" not in name and t.is_floating_point():
            total += t.numel() * t.element_size()
    for layer in model.model.layers:
        d = layer.self_attn.mla.dims
        total += batch * seq_len * (d.kv_lora_rank + d.qk_rope_head_dim) * layer.self_attn.mla.dtype.itemsize
    return total


def best(rounds: list[dict[str, object]]) -> dict[str, object]:
    return max(rounds, key=lambda r: r["tokens_per_s"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="alternating (unpatched, patched) rounds, best kept")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--backend", default="auto",
                    help="patch_model's backend: auto (the selector's choice: CPU_FUSED where it is built, else "
                         "REF_TORCH; the default) or a name")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args(argv)
    if args.new_tokens < 3:
        ap.error(f"--new-tokens: got {args.new_tokens}; supported >= 3")
    for name in ("batch", "prompt", "layers", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: got {getattr(args, name)}; supported >= 1")
    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads: got {args.threads}; supported >= 1")
        torch.set_num_threads(args.threads)
    from bench_layer_cpu import machine_rates

    from mla_backends.integrations.transformers import patch_model, unpatch_model

    load_start = os.getloadavg()
    model = build_model(args.layers)
    ids = torch.randint(1, 1024, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    bases, patches, rates = [], [], []
    for _ in range(args.rounds):  # alternating, so a burst of outside load hits one round of one side
        bases.append(run(model, ids, args.new_tokens))
        patch_model(model, backend=None if args.backend == "auto" else args.backend)
        used = sorted({layer.self_attn.mla.backend.name for layer in model.model.layers
                       if getattr(layer.self_attn, "mla", None) is not None})
        patches.append(run(model, ids, args.new_tokens))
        step_bytes = decode_step_bytes(model, args.batch, args.prompt + args.new_tokens // 2)
        unpatch_model(model)
        rates.append(machine_rates(3)["copy_bytes_per_s"])
    base, patched = best(bases), best(patches)
    same = all(torch.equal(b["sequences"], p["sequences"]) for b, p in zip(bases, patches, strict=True))
    bandwidth = max(rates)
    floor_s = step_bytes / bandwidth
    steps = patched["steps"]
    step_s = patched["decode_s"] / steps
    mqa_s, attn_s = patched["forward_mqa_s"] / steps, patched["attention_s"] / steps
    base_step_s = base["decode_s"] / base["steps"]
    res = {
        "batch": args.batch, "prompt": args.prompt, "new_tokens": args.new_tokens, "layers": args.layers,
        "rounds": args.rounds, "threads": torch.get_num_threads(), "backend": ", ".join(used),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset: active)"),
        "load_average_start": load_start[0], "load_average_end": os.getloadavg()[0],
        "transformers_tokens_per_s": base["tokens_per_s"], "patched_tokens_per_s": patched["tokens_per_s"],
        "decode_ratio": patched["tokens_per_s"] / base["tokens_per_s"],
        "attention_ratio": base["attention_s"] / patched["attention_s"], "identical_tokens": same,
        "rounds_tokens_per_s": [[b["tokens_per_s"], p["tokens_per_s"]] for b, p in zip(bases, patches,
                                                                                        strict=True)],
        "patched_step_s": step_s, "patched_median_step_s": patched["median_step_s"],
        "patched_forward_mqa_s": mqa_s, "patched_attention_s": attn_s, "transformers_step_s": base_step_s,
        "patched_step_bytes": step_bytes, "copy_bytes_per_s": bandwidth, "patched_floor_s": floor_s,
        "ratio_ceiling": base_step_s / floor_s,
    }
    print(f"DeepSeek-V2-Lite-shaped, {args.layers} dense layers, fp32, batch {args.batch}, prompts {args.prompt}, "
          f"{args.new_tokens} new tokens, {res['threads']} threads, OMP_WAIT_POLICY {res['omp_wait_policy']}, "
          f"load average {res['load_average_start']:.1f} -> {res['load_average_end']:.1f}")
    print(f"  transformers generate():        {res['transformers_tokens_per_s']:8.1f} decode tokens/s "
          f"({base_step_s * 1e3:.0f} ms a step)")
    print(f"  patched (mla-backends, {res['backend']}): {res['patched_tokens_per_s']:8.1f} decode tokens/s "
          f"({step_s * 1e3:.1f} ms a step, median {patched['median_step_s'] * 1e3:.1f}: forward_mqa "
          f"{mqa_s * 1e3:.1f}, rest of attention {(attn_s - mqa_s) * 1e3:.1f}, rest of the model "
          f"{(step_s - attn_s) * 1e3:.1f})")
    print("  rounds (unpatched, patched tokens/s): "
          + ", ".join(f"({b:.1f}, {p:.1f})" for b, p in res["rounds_tokens_per_s"]))
    print(f"  decode step ratio: {res['decode_ratio']:.1f}x (target >= 30x); attention only: "
          f"{res['attention_ratio']:.1f}x; tokens identical: {same}")
    print(f"  bound: a patched step reads {step_bytes / 1e6:.0f} MB (weights + cached rows), at the measured "
          f"{bandwidth / 1e9:.1f} GB/s copy bandwidth at least {floor_s * 1e3:.1f} ms, so this machine allows at "
          f"most {res['ratio_ceiling']:.0f}x against the unpatched step measured here")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(res, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
