"""Stand-ins for the CUDA attention ops, for CPU tests of the argument building, layouts and version dispatch.

``reference_forward`` / ``reference_backward`` compute variable-length attention with flash-attention semantics
(``[tokens, heads, dim]`` packed by ``cu_seqlens``, GQA when the KV heads divide the query heads, the backward given
the final output and log-sum-exp) in float64. The fakes wrap them with the signatures of torch's aten flash ops and
of flash-attn 2.5, 2.6 and 2.7/2.8, and record every call. On the ``meta`` device they only build outputs of the
right shape, device and dtype, so that a whole engine run on ``meta`` fails on any tensor created elsewhere or any
read of device data back to the host.
"""

from __future__ import annotations

import itertools
import types
from typing import Any

import torch


def _segments(cu_q: torch.Tensor, cu_k: torch.Tensor) -> list[tuple[int, int, int, int]]:
    q, k = cu_q.tolist(), cu_k.tolist()
    return [(a, b, c, d) for (a, b), (c, d) in zip(itertools.pairwise(q), itertools.pairwise(k), strict=True)]


def _check(q, k, cu_q, cu_k, max_q, max_k) -> None:
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32, (cu_q.dtype, cu_k.dtype)
    assert cu_q.device == q.device and cu_k.device == q.device
    assert isinstance(max_q, int) and isinstance(max_k, int), "max lengths must be host ints (no device sync)"
    assert q.dim() == 3 and k.dim() == 3 and q.shape[1] % k.shape[1] == 0


def reference_forward(q, k, v, cu_q, cu_k, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed output (q's dtype) and ``[heads, tokens]`` float32 log-sum-exp."""
    heads = q.shape[1]
    if q.device.type == "meta":
        return torch.empty_like(q), torch.empty((heads, q.shape[0]), dtype=torch.float32, device=q.device)
    rep = heads // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((heads, q.shape[0]), float("-inf"), dtype=torch.float64)
    for a, b, c, d in _segments(cu_q, cu_k):
        qs = q[a:b].double().transpose(0, 1)
        ks = k[c:d].double().transpose(0, 1).repeat_interleave(rep, 0)
        vs = v[c:d].double().transpose(0, 1).repeat_interleave(rep, 0)
        s = qs @ ks.transpose(1, 2) * scale
        if causal:
            s = s.masked_fill(torch.ones(b - a, d - c, dtype=torch.bool).triu(1 + (d - c) - (b - a)), float("-inf"))
        lse[:, a:b] = torch.logsumexp(s, -1)
        out[a:b] = (torch.softmax(s, -1) @ vs).transpose(0, 1)
    return out.to(q.dtype), lse.float()


def reference_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal: bool, scale: float):
    """``dq, dk, dv`` (inputs' dtypes) from the final output and ``[heads, tokens]`` log-sum-exp."""
    if q.device.type == "meta":
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    heads, kv_heads = q.shape[1], k.shape[1]
    rep = heads // kv_heads
    dq = torch.zeros(q.shape, dtype=torch.float64)
    dk = torch.zeros(k.shape, dtype=torch.float64)
    dv = torch.zeros(v.shape, dtype=torch.float64)
    for a, b, c, d in _segments(cu_q, cu_k):
        qs = q[a:b].double().transpose(0, 1)
        ks = k[c:d].double().transpose(0, 1).repeat_interleave(rep, 0)
        vs = v[c:d].double().transpose(0, 1).repeat_interleave(rep, 0)
        do = dout[a:b].double().transpose(0, 1)
        o = out[a:b].double().transpose(0, 1)
        s = qs @ ks.transpose(1, 2) * scale
        if causal:
            s = s.masked_fill(torch.ones(b - a, d - c, dtype=torch.bool).triu(1 + (d - c) - (b - a)), float("-inf"))
        p = torch.exp(s - lse[:, a:b].double().unsqueeze(-1))
        dp = do @ vs.transpose(1, 2)
        ds = p * (dp - (do * o).sum(-1, keepdim=True))
        dq[a:b] = (ds @ ks * scale).transpose(0, 1)
        dk_rep = (ds.transpose(1, 2) @ qs * scale).view(kv_heads, rep, d - c, -1).sum(1)
        dv_rep = (p.transpose(1, 2) @ do).view(kv_heads, rep, d - c, -1).sum(1)
        dk[c:d] += dk_rep.transpose(0, 1)
        dv[c:d] += dv_rep.transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FakeAtenOps:
    """``torch.ops.aten._flash_attention_forward`` / ``_flash_attention_backward`` with their 2.13 signatures.

    Args:
        padded_lse: Return the log-sum-exp as ``[batch, heads, max_q]`` (the ROCm layout).
        gqa: Accept fewer KV heads than query heads (else assert equal heads).
    """

    def __init__(self, padded_lse: bool = False, gqa: bool = True) -> None:
        self.padded_lse, self.gqa = padded_lse, gqa
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def forward(self, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                *, scale=None):  # fmt: skip
        _check(query, key, cum_seq_q, cum_seq_k, max_q, max_k)
        assert self.gqa or key.shape[1] == query.shape[1], "this op version takes equal head counts"
        assert dropout_p == 0.0 and return_debug_mask is False and scale is not None
        self.calls.append(("forward", {"heads": (query.shape[1], key.shape[1]), "causal": is_causal}))
        out, lse = reference_forward(query, key, value, cum_seq_q, cum_seq_k, is_causal, scale)
        if self.padded_lse and query.device.type != "meta":
            padded = torch.full((cum_seq_q.numel() - 1, query.shape[1], max_q), 7.0)  # junk beyond each length
            for i, (a, b) in enumerate(itertools.pairwise(cum_seq_q.tolist())):
                padded[i, :, : b - a] = lse[:, a:b]
            lse = padded
        rng = torch.empty(2, dtype=torch.uint64, device=query.device)
        return out, lse, rng, torch.empty(0, device=query.device), torch.empty(0, device=query.device)

    def backward(self, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                 is_causal, rng_state, unused, *, scale=None):  # fmt: skip
        _check(query, key, cum_seq_q, cum_seq_k, max_q, max_k)
        assert self.gqa or key.shape[1] == query.shape[1]
        if self.padded_lse:  # the layout this op's forward returned: [batch, heads, max_q]
            assert logsumexp.shape == (cum_seq_q.numel() - 1, query.shape[1], max_q), logsumexp.shape
            assert logsumexp.is_contiguous()
            logsumexp = torch.cat(
                [logsumexp[i, :, : b - a] for i, (a, b) in enumerate(itertools.pairwise(cum_seq_q.tolist()))], 1
            )
        assert logsumexp.shape == (query.shape[1], query.shape[0]) and logsumexp.dtype == torch.float32
        assert logsumexp.is_contiguous() and rng_state.device == query.device and unused.device == query.device
        self.calls.append(("backward", {"heads": (query.shape[1], key.shape[1]), "causal": is_causal}))
        return reference_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, is_causal, scale)


class FakeOpPacket:
    """A stand-in of an aten op packet such as ``torch.ops.aten._flash_attention_forward``: callable, with the
    schema at ``.default._schema`` (torch's own, or a patched one)."""

    def __init__(self, fn: Any, schema: Any) -> None:
        self._fn = fn
        self.default = types.SimpleNamespace(_schema=schema)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)


def aten_packets(ops: FakeAtenOps, replace: tuple[str, str] | None = None) -> tuple[FakeOpPacket, FakeOpPacket]:
    """``ops`` as the forward and backward op packets, with this torch's schemas; ``replace`` (``before, after``)
    edits the forward schema's text."""
    forward = str(torch.ops.aten._flash_attention_forward.default._schema)
    if replace is not None:
        assert replace[0] in forward, replace
        forward = forward.replace(*replace)
    backward = torch.ops.aten._flash_attention_backward.default._schema
    return FakeOpPacket(ops.forward, torch._C.parse_schema(forward)), FakeOpPacket(ops.backward, backward)


_FORWARD_DOC = "flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)"


def flash_interface(version: str, calls: list) -> types.SimpleNamespace:
    """A stand-in ``flash_attn.flash_attn_interface`` whose ``_flash_attn_varlen_backward`` has the signature of
    flash-attn ``version`` (``"2.5"``, ``"2.6"`` or ``"2.7"``; 2.7 and 2.8 register it as a torch custom op)."""

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False,
                               block_table=None):  # fmt: skip
        _check(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        assert return_attn_probs and dropout_p == 0.0
        calls.append(("forward", {"causal": causal}))
        out, lse = reference_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
        return out, lse, torch.empty(0, device=q.device)

    def _run(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, scale, causal, extra):
        _check(q, k, cu_q, cu_k, max_q, max_k)
        calls.append(("backward", {"causal": causal, **extra}))
        gq, gk, gv = reference_backward(dout, q, k, v, out, softmax_lse, cu_q, cu_k, causal, scale)
        dq.copy_(gq), dk.copy_(gk), dv.copy_(gv)

    if version == "2.5":

        def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                        alibi_slopes, deterministic, rng_state=None):  # fmt: skip
            assert tuple(window_size) == (-1, -1) and alibi_slopes is None
            _run(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 softmax_scale, causal, {"window_size": tuple(window_size)})  # fmt: skip

    elif version == "2.6":

        def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                        softcap, alibi_slopes, deterministic, rng_state=None):  # fmt: skip
            assert tuple(window_size) == (-1, -1) and softcap == 0.0
            _run(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 softmax_scale, causal, {"softcap": softcap})  # fmt: skip

    elif version == "2.7":
        name = f"fake_flash_{len(calls)}_{id(calls)}::varlen_bwd"

        @torch.library.custom_op(name, mutates_args=("dq", "dk", "dv"), device_types="cpu")
        def _flash_attn_varlen_backward(
            dout: torch.Tensor,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            out: torch.Tensor,
            softmax_lse: torch.Tensor,
            dq: torch.Tensor,
            dk: torch.Tensor,
            dv: torch.Tensor,
            cu_seqlens_q: torch.Tensor,
            cu_seqlens_k: torch.Tensor,
            max_seqlen_q: int,
            max_seqlen_k: int,
            dropout_p: float,
            softmax_scale: float,
            causal: bool,
            window_size_left: int,
            window_size_right: int,
            softcap: float,
            alibi_slopes: torch.Tensor | None,
            deterministic: bool,
            rng_state: torch.Tensor | None = None,
        ) -> torch.Tensor:
            assert window_size_left == -1 and window_size_right == -1
            _run(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 softmax_scale, causal, {"window_size_left": window_size_left})  # fmt: skip
            return torch.empty(0)

    else:
        raise ValueError(version)
    return types.SimpleNamespace(
        flash_attn_varlen_func=flash_attn_varlen_func, _flash_attn_varlen_backward=_flash_attn_varlen_backward
    )
