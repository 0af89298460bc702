"""The CPU attention kernel: ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` and its backward,
called once per *run* of sequences of equal chunk size.

The CPU op is not variable-length: it takes ``[batch, heads, length, dim]`` (any strides), and pays a fixed cost
per call and per (batch entry, head). Gathering sequences of similar length into padded batches costs a copy of
every operand and output: measured during development on the 400-document bin (``python -m
lightning_hydra.bench.cp --short-docs``), index gathers and scatters took 62 ms against 100 ms of op time, more
than the batching saved. Instead, the zigzag shard lists sequences by decreasing chunk size
(:mod:`lightning_hydra.cp.layout`), so the sequences of equal chunk size ``C`` form a run of adjacent ``2 C``-row
blocks on every member and at every ring step: the run is one batch of the op, read and written through strided
views, without any gather or scatter:

- causal diagonal: ``[n, 2C]`` queries against ``[n, 2C]`` keys with the op's causal mask (top-left aligned; the
  padding is a suffix of each sequence, which no real query sees);
- ring steps off the diagonal: ``[n, 2C]`` queries against the first halves ``[n, :C]`` of the keys, or the second
  halves ``[n, C:]`` of the queries against ``[n, 2C]`` keys (no mask);
- without the causal mask, a key-padding mask hides each sequence's padded keys; a sequence with no key in the
  block gets ``lse = -inf`` (the op returns 0 there);
- short sequences whose keys were gathered (:meth:`CpuKernel.prepare_gathered`): each local chunk against its
  causal prefix of the position-ordered keys (a bottom-right causal mask), both chunks in one call when the
  masked-out work is small; with grouped-query attention and few query rows, the query heads that share a KV head
  are folded into the query length (fewer, larger calls).

Grouped-query attention is passed to the op natively (fewer KV heads).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from lightning_hydra.cp.blocks import Accumulator, Segments, merge_rows, write_rows

__all__ = ["CpuKernel", "CpuRun", "CpuStep"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Activation dtypes the CPU path runs. Not float64: the log-sum-exp and the ring's merges and dK/dV sums are float32
by design (:mod:`lightning_hydra.cp.ring`), and the op's backward refuses a float32 log-sum-exp beside float64
activations (float64 crashed there at every degree, and in the forward merge at ring degree 2 and up)."""
_COMBINE_WASTE = 512
"""A gathered sequence's two local chunks go in one call (masked keys computed for nothing: ``(2r - 1) C^2`` per
head) while that waste is below about one call's fixed cost per head (measured: ~2 us, ~300-500 score elements)."""


@dataclass
class CpuRun:
    """One call of the op: ``n`` adjacent sequences of ``block`` query rows and ``k_block`` key rows each."""

    start: int
    """First query row of the run (in the local tensors)."""
    n: int
    """Sequences in the run."""
    block: int
    """Rows of each sequence in the query tensor (``2 C``)."""
    q_off: int
    """First query row inside each block."""
    lq: int
    """Query rows of each sequence."""
    lk: int
    """Key rows of each sequence (a prefix of its key block)."""
    causal: bool
    """``is_causal`` of the op."""
    k_start: int
    """First key row of the run (in the key tensor)."""
    k_block: int
    """Rows of each sequence in the key tensor."""
    allowed: np.ndarray | None = None
    """Boolean mask broadcastable to ``[n, heads, lq, lk]`` (``None``: every key visible)."""
    dead: torch.Tensor | None = None
    """``[n, 1, 1]`` sequences without keys at this step (``None``: none)."""
    masks: dict[tuple[torch.dtype, int], torch.Tensor] = field(default_factory=dict)

    def mask(self, dtype: torch.dtype, fold: int = 1) -> torch.Tensor | None:
        """Additive mask in ``dtype`` (built once per dtype), its query rows tiled ``fold`` times."""
        if self.allowed is None:
            return None
        m = self.masks.get((dtype, fold))
        if m is None:
            allowed = torch.from_numpy(self.allowed)
            if allowed.shape[2] > 1:
                allowed = allowed.repeat(1, 1, fold, 1)
            m = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
            self.masks[(dtype, fold)] = m
        return m

    def view(self, x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """``[n, heads, hi - lo, ...]`` view of rows ``lo:hi`` of every query block of a token-major tensor."""
        blocks = x[self.start : self.start + self.n * self.block].view(self.n, self.block, *x.shape[1:])
        return blocks[:, lo:hi].transpose(1, 2)

    def kview(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, heads, lk, ...]`` view of the visible key rows of every key block."""
        blocks = x[self.k_start : self.k_start + self.n * self.k_block].view(self.n, self.k_block, *x.shape[1:])
        return blocks[:, : self.lk].transpose(1, 2)


@dataclass
class CpuStep:
    """The runs of one ring step."""

    runs: list[CpuRun]
    covers_q: bool
    """The runs write every query row (accumulators need no initialisation)."""
    covers_k: bool
    """The runs write every key row."""


def _runs(seg: Segments) -> CpuStep:
    block = seg.block
    edges = np.flatnonzero(np.r_[True, block[1:] != block[:-1], True]) if block.size else np.zeros(1, np.int64)
    runs, q_cover, k_cover = [], 0, 0
    for a, b in itertools.pairwise(edges.tolist()):
        if block[a] == 0:
            continue  # empty sequences: no rows
        k_len = seg.k_len[a:b]
        lk = int(k_len.max())
        if lk == 0:
            continue  # nothing to see in this block: rows stay at out 0, lse -inf
        lq = int(seg.q_len[a])
        q_off = int(seg.q_start[a] - seg.start[a])
        start = int(seg.start[a])
        run = CpuRun(start, b - a, int(block[a]), q_off, lq, lk, seg.causal, start, int(block[a]))
        if not seg.causal and bool((k_len < lk).any()):
            run.allowed = (np.arange(lk)[None, :] < k_len[:, None])[:, None, None, :]
            if bool((k_len == 0).any()):
                run.dead = torch.from_numpy(k_len == 0)[:, None, None]
        runs.append(run)
        q_cover += run.n * lq
        k_cover += int(k_len.sum())
    return CpuStep(runs, q_cover == seg.q_rows, k_cover == seg.k_rows)


@dataclass
class CpuGathered:
    """The calls for the gathered (short) sequences: their keys arrive whole, in position order."""

    runs: list[CpuRun]
    covers_q: bool = True
    """Every local row of the gathered sequences is written."""


def _gathered_runs(
    lengths: np.ndarray, chunks: np.ndarray, ring: int, pos: int, causal: bool, row0: int
) -> CpuGathered:
    c = np.asarray(chunks, dtype=np.int64)
    q_starts = row0 + np.cumsum(2 * c) - 2 * c
    k_starts = np.cumsum(2 * ring * c) - 2 * ring * c
    edges = np.flatnonzero(np.r_[True, c[1:] != c[:-1], True]) if c.size else np.zeros(1, np.int64)
    runs = []
    for a, b in itertools.pairwise(edges.tolist()):
        size = int(c[a])
        if size == 0:
            continue
        common = {"start": int(q_starts[a]), "n": b - a, "block": 2 * size, "causal": False}
        common |= {"k_start": int(k_starts[a]), "k_block": 2 * ring * size}
        if causal and (2 * ring - 1) * size * size <= _COMBINE_WASTE:
            # both local chunks in one call: rows i < C are at positions pos*C + i, rows C + i at (2r-1-pos)*C + i
            lk = 2 * ring * size
            rows = np.arange(2 * size)
            last = np.where(rows < size, pos * size + rows, (2 * ring - 1 - pos) * size + rows - size)
            allowed = np.arange(lk)[None, :] <= last[:, None]
            runs.append(CpuRun(q_off=0, lq=2 * size, lk=lk, allowed=allowed[None, None], **common))
        elif causal:
            # chunk pos (positions pos*C + i) and chunk 2r-1-pos: keys up to their own position (bottom-right causal)
            for q_off, first in ((0, pos * size), (size, (2 * ring - 1 - pos) * size)):
                lk = first + size
                allowed = np.arange(lk)[None, :] <= first + np.arange(size)[:, None]
                runs.append(CpuRun(q_off=q_off, lq=size, lk=lk, allowed=allowed[None, None], **common))
        else:
            n = lengths[a:b]
            lk = int(n.max())
            allowed = None if bool((n == lk).all()) else (np.arange(lk)[None, :] < n[:, None])[:, None, None, :]
            runs.append(CpuRun(q_off=0, lq=2 * size, lk=lk, allowed=allowed, **common))
    return CpuGathered(runs)


_FOLD_ROWS = 32
"""Gathered calls with at most this many query rows per sequence fold the query heads that share a KV head into the
query length: a quarter of the op's per-(sequence, head) calls with 4 query heads per KV head, for a copy of the
queries (measured on 50 sequences of 2-16 query rows, 8 query and 2 KV heads: 4-30% less time, copies included)."""


def _fold(run: CpuRun, heads: int, kv_heads: int) -> int:
    return heads // kv_heads if run.lq <= _FOLD_ROWS else 1


def _folded(x: torch.Tensor, kv_heads: int, g: int) -> torch.Tensor:
    """``[n, H, L, ...]`` -> ``[n, Hkv, g * L, ...]`` (query head ``j * g + m`` to rows ``m * L ..``); a copy."""
    if g == 1:
        return x
    return x.unflatten(1, (kv_heads, g)).flatten(2, 3)


def _unfolded(x: torch.Tensor, g: int) -> torch.Tensor:
    """``[n, H, L, ...]`` view as ``[n, H / g, g, L, ...]`` (the target of a result folded ``g`` times)."""
    return x.unflatten(1, (x.shape[1] // g, g))


class CpuKernel:
    """The CPU flash-attention op, one call per run of equal-sized sequences (see the module docstring).

    Args:
        gather_limit: Sequences whose padded length is at most this many tokens are not sent around the ring
            step by step: their keys are collected from the passing blocks and each local query chunk attends to
            its whole causal prefix in one call (see :mod:`lightning_hydra.cp.ring`). The CPU op pays per query
            row and call, which a ring multiplies by about ``1 + 0.75 (ring - 1)`` for short sequences. 0: never.
    """

    name = "cpu"

    def __init__(self, gather_limit: int = 2048) -> None:
        self.gather_limit = int(gather_limit)

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raise ``TypeError`` unless the CPU op supports ``dtype``."""
        if dtype not in _DTYPES:
            raise TypeError(
                f"the cpu attention kernel takes {', '.join(map(str, _DTYPES))}, not {dtype} (merges and the "
                "log-sum-exp are float32: run the model in float32 or lower)"
            )

    def prepare(self, seg: Segments, *, heads: int, kv_heads: int, device: torch.device) -> CpuStep:
        """The runs of one step (host bookkeeping only: the op reads views)."""
        return _runs(seg)

    def prepare_gathered(
        self, lengths: np.ndarray, chunks: np.ndarray, *, ring: int, pos: int, causal: bool, row0: int
    ) -> CpuGathered:
        """The calls for the gathered sequences (``lengths``/``chunks`` in shard order, rows from ``row0``)."""
        return _gathered_runs(lengths, chunks, ring, pos, causal, row0)

    def gathered_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CpuGathered, scale: float, acc: Accumulator
    ) -> None:
        """Attention of the gathered sequences' local queries against their position-ordered keys ``k``, ``v``
        (``[sum 2 r C, kv_heads, dim]``); writes the final rows of ``acc``."""
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out3, lse2 = acc.out3(), acc.lse2()
        kv_heads = k.shape[1]
        for run in plan.runs:
            hi = run.q_off + run.lq
            g = _fold(run, q.shape[1], kv_heads)
            o, lo = op(
                _folded(run.view(q, run.q_off, hi), kv_heads, g),
                run.kview(k),
                run.kview(v),
                0.0,
                False,
                attn_mask=run.mask(q.dtype, g),
                scale=scale,
            )
            _unfolded(run.view(out3, run.q_off, hi), g).copy_(o.unflatten(2, (g, run.lq)))
            _unfolded(run.view(lse2, run.q_off, hi), g).copy_(lo.unflatten(2, (g, run.lq)))

    def gathered_backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        plan: CpuGathered,
        scale: float,
        dq: torch.Tensor,
    ) -> torch.Tensor:
        """Gradients of the gathered sequences: writes their query rows of the flat ``dq``; returns the float32
        gradients of the position-ordered keys and values, ``[2, sum 2 r C, kv_heads, dim]``."""
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        t, heads, dim = q.shape
        lse2 = lse[: t * heads].view(t, heads)
        dq3 = dq[: t * heads].view(t, heads, dim)
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
        dk, dv = dkv[0], dkv[1]
        kv_heads = k.shape[1]
        for run in plan.runs:
            hi = run.q_off + run.lq
            g = _fold(run, heads, kv_heads)
            gq, gk, gv = op(
                _folded(run.view(dout, run.q_off, hi), kv_heads, g),
                _folded(run.view(q, run.q_off, hi), kv_heads, g),
                run.kview(k),
                run.kview(v),
                _folded(run.view(out, run.q_off, hi), kv_heads, g),
                _folded(run.view(lse2, run.q_off, hi), kv_heads, g),
                0.0,
                False,
                attn_mask=run.mask(q.dtype, g),
                scale=scale,
            )
            _unfolded(run.view(dq3, run.q_off, hi), g).copy_(gq.unflatten(2, (g, run.lq)))
            run.kview(dk).add_(gk)
            run.kview(dv).add_(gv)
        return dkv

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        step: CpuStep,
        scale: float,
        acc: Accumulator,
        first: bool,
    ) -> None:
        """Attention of the step's runs; the first step writes ``acc``, later ones merge into it."""
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out3, lse2 = acc.out3(), acc.lse2()
        for run in step.runs:
            hi = run.q_off + run.lq
            o, lo = op(
                run.view(q, run.q_off, hi),
                run.kview(k),
                run.kview(v),
                0.0,
                run.causal,
                attn_mask=run.mask(q.dtype),
                scale=scale,
            )
            if run.dead is not None:
                lo.masked_fill_(run.dead, float("-inf"))  # the op returns lse 0 for a row without keys
            dst_o, dst_l = run.view(out3, run.q_off, hi), run.view(lse2, run.q_off, hi)
            if first:
                dst_o.copy_(o)
                dst_l.copy_(lo)
            else:
                merge_rows(dst_o, dst_l, None, o, lo)

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        step: CpuStep,
        scale: float,
        dq: torch.Tensor,
        dq_add: bool,
    ) -> Callable[[torch.Tensor, torch.Tensor, bool], None]:
        """Gradients of the step's runs given the *final* ``out`` and flat ``lse`` (no ``-inf`` in it).

        ``dq`` (flat, with sink) receives the query gradients now; the returned function writes (or adds) the key
        and value gradients into flat targets ``[k_rows * kv_heads + 1, dim]`` later.
        """
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        t, heads, dim = q.shape
        lse2 = lse[: t * heads].view(t, heads)
        dq3 = dq[: t * heads].view(t, heads, dim)
        parts = []
        for run in step.runs:
            hi = run.q_off + run.lq
            gq, gk, gv = op(
                run.view(dout, run.q_off, hi),
                run.view(q, run.q_off, hi),
                run.kview(k),
                run.kview(v),
                run.view(out, run.q_off, hi),
                run.view(lse2, run.q_off, hi),
                0.0,
                run.causal,
                attn_mask=run.mask(q.dtype),
                scale=scale,
            )
            write_rows(run.view(dq3, run.q_off, hi), None, gq, add=dq_add)
            parts.append((run, gk, gv))
        tk, kv_heads = k.shape[0], k.shape[1]

        def apply(dk: torch.Tensor, dv: torch.Tensor, add: bool) -> None:
            dk3 = dk[: tk * kv_heads].view(tk, kv_heads, dim)
            dv3 = dv[: tk * kv_heads].view(tk, kv_heads, dim)
            for run, gk, gv in parts:
                write_rows(run.kview(dk3), None, gk, add)
                write_rows(run.kview(dv3), None, gv, add)

        return apply
