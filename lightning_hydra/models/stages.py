"""How a model's blocks are dealt to pipeline stages (pure arithmetic, shared by every model that splits)."""

from __future__ import annotations

import itertools

from torch import nn

__all__ = ["keep_stage_layers", "stage_layers"]


def stage_layers(
    num_layers: int, stages: int, *, block_flops: float, embed_flops: float = 0.0, head_flops: float = 0.0
) -> list[range]:
    """Contiguous block ranges per stage minimising the largest stage's per-token FLOPs (the first stage also runs
    the embedding, the last the head); every stage gets at least one block.

    Raises:
        ValueError: Fewer blocks than stages.
    """
    if stages < 1:
        raise ValueError(f"stages must be positive, got {stages}")
    if num_layers < stages:
        raise ValueError(f"{num_layers} transformer blocks cannot fill {stages} pipeline stages (one block at least)")
    # best[s][k]: smallest achievable maximum for the first k blocks over s stages (stage 0 carries the embedding)
    inf = float("inf")
    best = [[inf] * (num_layers + 1) for _ in range(stages + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for k in range(s, num_layers - (stages - s) + 1):
            for j in range(s - 1, k):
                load = (k - j) * block_flops + (embed_flops if s == 1 else 0.0)
                load += head_flops if s == stages else 0.0
                value = max(best[s - 1][j], load)
                if value < best[s][k]:
                    best[s][k], cut[s][k] = value, j
    bounds = [num_layers]
    for s in range(stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def keep_stage_layers(layers: nn.ModuleList, stage: int, stages: int, *, head_flops: float) -> range:
    """Replace every block of ``layers`` outside stage ``stage``'s share (:func:`stage_layers`, blocks weighed by
    ``6 x`` their parameters per token, the last stage also carrying ``head_flops``) by ``nn.Identity``, which
    drops its parameters; returns the kept range. Indices (and state-dict keys) of kept blocks do not change."""
    block = sum(p.numel() for p in layers[0].parameters())
    keep = stage_layers(len(layers), stages, block_flops=6.0 * block, head_flops=head_flops)[stage]
    for i in range(len(layers)):
        if i not in keep:
            layers[i] = nn.Identity()
    return keep
