"""Reference tokens for engines' integration tests: what transformers itself generates from a checkpoint, greedy,
in float32. Imports transformers when called, never on import."""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["hf_greedy_tokens"]


def hf_greedy_tokens(path: str | os.PathLike, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own ``generate()`` of the checkpoint at ``path`` (float32, greedy, one prompt at a time,
    exactly ``max_new_tokens`` each): the new token ids of every prompt (``prompts``: lists of token ids)."""
    from ..core.validation import require_int

    require_int("max_new_tokens", max_new_tokens, minimum=1)
    if isinstance(prompts, (str, bytes)) or not all(
            len(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompts):
        raise TypeError(f"prompts: got {prompts!r:.80}; supported a sequence of non-empty lists of token ids")
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([list(p)])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs
