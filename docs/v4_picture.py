"""Draw docs/v4-keys.png: which keys each query of a DeepSeek-V4 prefill sees (``python docs/v4_picture.py``).

Two small random layers (window 8; CSA with ratio 4 and top-3; HCA with ratio 8) run one 40-token prefill through
mla-backends (REF_TORCH). Row ``p`` of each panel is the query at position ``p``, column ``j`` a token position:
its window's tokens, the compressed entries it may see (an entry's cell spans the tokens it pools, and it is
visible once its last token is there), and on the CSA panel the entries the indexer picked. Every mark comes from
the library: the window from the layer's ``sliding_window``, visibility from the step plan
(``mla_backends.step.v4``), the picks from the layer's ``last_topk_indices``.
"""

from __future__ import annotations

import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from mla_backends import BatchMetadata, plan_step  # noqa: E402
from mla_backends.core.v4dims import CSA, HCA, SLIDING, V4Dims  # noqa: E402
from mla_backends.layer.v4 import V4Attention  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
N, WINDOW = 40, 8
COLORS = ["#ffffff", "#f6d7b0", "#e07b24", "#4c72b0"]  # unseen, visible entry, picked entry, window
LABELS = ["not seen", "compressed entry, visible", "compressed entry, attended", "window token"]


def _layers() -> list[V4Attention]:
    dims = V4Dims(num_heads=2, head_dim=32, rope_head_dim=8, q_lora_rank=16, hidden_size=32, num_layers=3,
                  layer_types=(SLIDING, CSA, HCA), csa_ratio=4, hca_ratio=8, sliding_window=WINDOW, index_n_heads=2,
                  index_head_dim=16, index_topk=3, o_groups=2, o_lora_rank=8)
    g = torch.Generator().manual_seed(0)
    layers = []
    for i in (1, 2):
        layer = V4Attention(dims, layer_idx=i, dtype=torch.float64, backend="REF_TORCH")
        layer.load_hf_state_dict({k: 0.3 * torch.randn(v.shape, generator=g, dtype=torch.float64)
                                  + (1.0 if "norm" in k else 0.0) for k, v in layer.state_dict().items()})
        layers.append(layer)
    return layers


def key_map(layer: V4Attention) -> np.ndarray:
    """``[N, N]`` codes (index of ``COLORS``) of what each query of a prefill of ``N`` tokens sees."""
    cache = layer.allocate_cache(N // 4, 4)
    meta = BatchMetadata.build([N], [0], [list(range(N // 4))], 4)
    plan = plan_step(meta, [layer])
    x = torch.randn(N, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    layer(x, None, cache, plan)
    entries = plan.state(layer.planner, meta).for_kind(layer.kind)
    r = layer.ratio
    grid = np.zeros((N, N), dtype=int)
    for p in range(N):
        seen = [int(e) for e in entries.seen[p] if e >= 0]
        picked = seen if layer.kind == HCA else [int(e) for e in layer.last_topk_indices[p] if e >= 0]
        for e in seen:
            grid[p, e * r:(e + 1) * r] = 2 if e in picked else 1
        grid[p, max(0, p - WINDOW + 1):p + 1] = 3
    return grid


def main() -> int:
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "v4-keys.png")
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.4), sharey=True)
    cmap = ListedColormap(COLORS)
    for ax, layer in zip(axes, _layers(), strict=True):
        ax.imshow(key_map(layer), cmap=cmap, vmin=0, vmax=3, interpolation="nearest")
        name = "CSA: ratio 4, top-3 entries" if layer.kind == CSA else "HCA: ratio 8, every visible entry"
        ax.set_title(f"{name}, window {WINDOW}", fontsize=10)
        ax.set_xlabel("token position (key)")
        for k in range(0, N + 1, layer.ratio):
            ax.axvline(k - 0.5, color="#999999", lw=0.3)
    axes[0].set_ylabel("query position")
    fig.legend(handles=[Patch(facecolor=c, edgecolor="#999999", label=t) for c, t in zip(COLORS, LABELS,
                                                                                          strict=True)],
               loc="lower center", ncol=4, fontsize=9)
    fig.suptitle("What a DeepSeek-V4 query attends to (one 40-token prefill; the sink is not drawn)", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
