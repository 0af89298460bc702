"""The CP engine on real processes: outputs and gradients equal a one-process per-document reference."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from lightning_hydra.cp import GroupCache, hydra_attn_func, zigzag_shard, zigzag_unshard
from lightning_hydra.cp.cpu_kernel import CpuKernel
from lightning_hydra.cp.layout import ZigzagMeta, zigzag_positions, zigzag_source_index
from lightning_hydra.planner import Group
from lightning_hydra.testing import run_world

LENGTHS = [37, 5, 64, 2, 19]  # not multiples of 2d; two shorter than 2d for d >= 4
SHORT = [3, 1, 9, 9, 9, 2, 12, 1, 5, 7, 7, 11, 1, 4, 4, 4, 4, 6, 10, 2]
"""Many short documents, most shorter than 2d: runs of equal size and, without the causal mask, empty key sets."""
GATHER_LIMITS = (0, 32, 2048)
"""CPU kernels whose short sequences go around the ring (0), partly (32) or all (2048) through the gathered path."""


def _cu(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _reference(q, k, v, cu, causal):
    """Per-document attention in one process (GQA by repeating KV heads)."""
    rep = q.shape[1] // k.shape[1]
    outs = []
    for a, b in itertools.pairwise(cu):
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                q[a:b].transpose(0, 1).float(),
                k[a:b].transpose(0, 1).repeat_interleave(rep, 0).float(),
                v[a:b].transpose(0, 1).repeat_interleave(rep, 0).float(),
                is_causal=causal,
            ).transpose(0, 1)
        )
    return torch.cat(outs)


def _bin(seed: int, lengths: list[int], heads: int, kv_heads: int, dim: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v, dout = (torch.randn(total, h, dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads, heads))
    return q, k, v, dout


def _run_case(
    rank: int,
    cache: GroupCache,
    groups: list[Group],
    *,
    heads: int,
    kv_heads: int,
    causal: bool,
    dtype: torch.dtype,
    dim: int = 16,
    gather: int = 2048,
    lengths: list[int] | None = None,
    floor: float = 1e-12,
) -> dict[str, float]:
    """Every group runs its own bin at the same time; each rank checks its shard against the reference."""
    cache.prepare(groups)
    mine = next(g for g in groups if rank in g.ranks)
    seed = 1000 + mine.ranks[0]
    lengths = lengths or LENGTHS[: 3 + mine.ranks[0] % 3]  # groups hold different bins
    cu = _cu(lengths)
    q, k, v, dout = _bin(seed, lengths, heads, kv_heads, dim, dtype)
    ref_in = [x.float().clone().requires_grad_() for x in (q, k, v)]
    ref = _reference(*ref_in, cu, causal)
    ref.backward(dout.float())
    d, j = mine.degree, mine.ranks.index(rank)
    shards = [zigzag_shard(x, cu, d, j).clone().requires_grad_() for x in (q, k, v)]
    group = cache.get(mine.ranks, mine.ulysses, mine.ring)
    out = hydra_attn_func(*shards, cu, group=group, causal=causal, kernel=CpuKernel(gather))
    out.backward(zigzag_shard(dout, cu, d, j))
    real = zigzag_source_index(ZigzagMeta.from_cu_seqlens(cu, d), j)[1] >= 0  # padding rows of out: unspecified
    errors = {}
    pairs = [("out", out.detach()[real], zigzag_shard(ref.detach(), cu, d, j)[real])] + [
        (name, s.grad, zigzag_shard(x.grad, cu, d, j))
        for name, s, x in zip(("dq", "dk", "dv"), shards, ref_in, strict=True)
    ]
    for name, got, want in pairs:
        want = want.to(got.dtype).float()
        if not want.numel():  # a member holding only padding
            errors[name] = 0.0
            continue
        errors[name] = float((got.float() - want).abs().max() / want.abs().max().clamp_min(floor))
    return errors


FACTORIZATIONS = {1: [(1, 1)], 2: [(1, 2), (2, 1)], 4: [(1, 4), (2, 2), (4, 1)], 8: [(1, 8), (2, 4), (4, 2), (8, 1)]}


def _uniform_groups(world: int, u: int, r: int) -> list[Group]:
    d = u * r
    return [Group(tuple(range(s, s + d)), u, r) for s in range(0, world, d)]


def _engine_worker(rank: int, world: int, cases: list[tuple]) -> list[tuple]:
    cache = GroupCache()
    results = []
    for label, groups, kwargs in cases:
        results.append((label, _run_case(rank, cache, groups, **kwargs)))
    # the same plans again: no new process group, no new communication buffer
    before, buffers = cache.created, cache.buffers.allocations
    for _, groups, _ in cases:
        assert cache.prepare(groups) == 0
    label, groups, kwargs = cases[-1]
    _run_case(rank, cache, groups, **kwargs)
    results.append(
        (
            "cache",
            {
                "created_again": float(cache.created - before),
                "buffers_again": float(cache.buffers.allocations - buffers),
            },
        )
    )
    return results


def _cases(world: int) -> list[tuple]:
    cases = []
    for d, facts in FACTORIZATIONS.items():
        if d > world:
            continue
        for u, r in facts:
            for causal in (True, False):
                for heads, kv in ((8, 4), (8, 2)):  # KV heads divisible by u or not (replicated)
                    gather = GATHER_LIMITS[len(cases) % len(GATHER_LIMITS)]
                    kwargs = dict(heads=heads, kv_heads=kv, causal=causal, dtype=torch.float32, gather=gather)
                    label = f"d{d} u{u} r{r} causal={causal} H{heads}/{kv} gather<={gather}"
                    cases.append((label, _uniform_groups(world, u, r), kwargs))
    if world == 4:  # many short documents on the 4-rank factorizations, every path
        for (u, r), causal, gather in itertools.product(FACTORIZATIONS[4], (True, False), (0, 2048)):
            kwargs = dict(heads=8, kv_heads=2, causal=causal, dtype=torch.float32, gather=gather, lengths=SHORT)
            cases.append((f"short u{u} r{r} causal={causal} gather<={gather}", _uniform_groups(4, u, r), kwargs))
        # only block 0 holds keys: rank 0 has nothing to attend after its first step, the others have; the KV
        # blocks must still travel on every member alike. One-token documents have dq = dk = 0 exactly (round-off
        # only here): errors relative to at least 1
        kwargs = dict(heads=8, kv_heads=2, causal=False, dtype=torch.float32, gather=0, lengths=[1, 1, 1], floor=1.0)
        cases.append(("tiny non-causal r4", _uniform_groups(4, 1, 4), kwargs))
    return cases


def _eight_rank_worker(rank: int, world: int, cases: list[tuple]) -> dict[str, list[tuple]]:
    """The 8-rank tests' work in one launch (starting 8 ranks on 2 cores costs more than the cases)."""
    return {"factorizations": _engine_worker(rank, world, cases), "mixed": _mixed_worker(rank, world)}


@pytest.fixture(scope="module")
def eight_ranks() -> list[dict[str, list[tuple]]]:
    """Per rank, the results of :func:`_eight_rank_worker` on 8 gloo ranks."""
    return run_world(8, _eight_rank_worker, _cases(8), timeout=600)


@pytest.mark.parametrize("world", [4, 8])
def test_every_factorization_matches_one_process(world: int, request: pytest.FixtureRequest) -> None:
    if world == 8:
        results = [rank["factorizations"] for rank in request.getfixturevalue("eight_ranks")]
    else:
        results = run_world(world, _engine_worker, _cases(world), timeout=600)
    for rank_results in results:
        for label, errors in rank_results:
            if label == "cache":
                assert errors["created_again"] == 0 and errors["buffers_again"] == 0, errors
                continue
            worst = max(errors.values())
            assert worst <= 1e-5, f"{label}: relative errors {errors}"


def _mixed_worker(rank: int, world: int) -> list[tuple]:
    # 4 + 2 + 1 + 1 at world 8, all at once, plus a bf16 run of the same plan
    groups = [Group((0, 1, 2, 3), 2, 2), Group((4, 5), 1, 2), Group((6,), 1, 1), Group((7,), 1, 1)]
    cache = GroupCache()
    out = [("mixed fp32", _run_case(rank, cache, groups, heads=8, kv_heads=2, causal=True, dtype=torch.float32))]
    out.append(("mixed bf16", _run_case(rank, cache, groups, heads=8, kv_heads=2, causal=True, dtype=torch.bfloat16)))
    out.append(
        (
            "ring bf16",
            _run_case(rank, cache, groups, heads=8, kv_heads=2, causal=True, dtype=torch.bfloat16, gather=0),
        )
    )
    out.append(("groups", {"held": float(len(cache)), "created": float(cache.created)}))
    return out


BF16_BOUND = 2e-2
"""Relative bound in bfloat16: inputs and outputs carry 8 mantissa bits (about 4e-3), merged over a few blocks."""


def test_groups_of_different_sizes_run_at_once(eight_ranks: list[dict[str, list[tuple]]]) -> None:
    for rank_results in (rank["mixed"] for rank in eight_ranks):
        by_label = dict(rank_results)
        assert max(by_label["mixed fp32"].values()) <= 1e-5, by_label["mixed fp32"]
        assert max(by_label["mixed bf16"].values()) <= BF16_BOUND, by_label["mixed bf16"]
        assert max(by_label["ring bf16"].values()) <= BF16_BOUND, by_label["ring bf16"]
        assert by_label["groups"]["created"] == 2  # the two Ulysses blocks (0,1) and (2,3); rings need none


def _bad_input_worker(rank: int, world: int) -> list[str]:
    cache = GroupCache()
    groups = [Group((0, 1), 2, 1), Group((2, 3), 1, 2)]
    cache.prepare(groups)
    cu = _cu([7, 3])
    q = torch.randn(10, 6, 8)
    k = torch.randn(10, 2, 8)
    messages = []
    other = groups[1] if rank in (0, 1) else groups[0]
    mine = groups[0] if rank in (0, 1) else groups[1]
    handle = cache.get(mine.ranks, mine.ulysses, mine.ring)
    j = mine.ranks.index(rank)
    qs, ks = zigzag_shard(q, cu, 2, j), zigzag_shard(k, cu, 2, j)
    checks = [
        lambda: hydra_attn_func(qs, ks, ks, cu, group=cache.get(other.ranks, other.ulysses, other.ring)),
        lambda: hydra_attn_func(qs[:-2], ks[:-2], ks[:-2], cu, group=handle),
        lambda: hydra_attn_func(qs.to(torch.int64), ks.to(torch.int64), ks.to(torch.int64), cu, group=handle),
    ]
    if mine.ulysses == 2:
        q5 = zigzag_shard(torch.randn(10, 5, 8), cu, 2, j)
        k5 = zigzag_shard(torch.randn(10, 1, 8), cu, 2, j)
        checks.append(lambda: hydra_attn_func(q5, k5, k5, cu, group=handle))
    for check in checks:
        try:
            check()
            messages.append("no error")
        except (ValueError, TypeError) as exc:
            messages.append(type(exc).__name__ + ": " + str(exc))
    dist.barrier()
    return messages


def test_bad_input_gets_a_clear_error() -> None:
    for rank, messages in enumerate(run_world(4, _bad_input_worker, timeout=120)):
        assert "not a member" in messages[0]
        assert "zigzag shard" in messages[1]
        assert "TypeError" in messages[2]
        if rank in (0, 1):
            assert "cannot be split over a Ulysses degree of 2" in messages[3]


@pytest.mark.parametrize("degree", [1, 2, 3, 4])
def test_zigzag_round_trip_and_positions(degree: int) -> None:
    cu = _cu(LENGTHS)
    x = torch.arange(sum(LENGTHS) * 2, dtype=torch.float32).view(-1, 2) + 1
    shards = [zigzag_shard(x, cu, degree, j) for j in range(degree)]
    assert all(s.shape[0] == shards[0].shape[0] for s in shards)
    torch.testing.assert_close(zigzag_unshard(shards, cu, degree), x)
    for j in range(degree):
        pos = zigzag_positions(cu, degree, j)
        # real tokens carry their position inside their own document; padding is zero
        flat = torch.cat([torch.arange(n, dtype=torch.float32) for n in LENGTHS])
        doc_start = torch.cat([torch.full((n,), float(a)) for a, n in zip(cu, LENGTHS, strict=False)])
        real = shards[j][:, 0] != 0
        src = ((shards[j][real, 0] - 1) / 2).long()
        assert torch.equal(pos[real].float(), flat[src])
        assert torch.equal(flat[src] + doc_start[src], src.float())
        assert torch.all(shards[j][~real] == 0)


def test_zigzag_rejects_mismatched_input() -> None:
    with pytest.raises(ValueError):
        zigzag_shard(torch.zeros(10, 2), [0, 4, 9], 2, 0)
    with pytest.raises(ValueError):
        zigzag_shard(torch.zeros(9, 2), [0, 4, 9], 2, 2)
    with pytest.raises(ValueError):
        zigzag_unshard([torch.zeros(3, 2)], [0, 4, 9], 2)
