"""Variable-length CUDA attention kernels: one call per ring step for the whole bin.

- ``torch``: PyTorch's own packed flash attention, ``torch.ops.aten._flash_attention_forward`` and
  ``_flash_attention_backward`` (the ops beneath ``torch.nn.attention.varlen.varlen_attn``). Needs nothing but a
  CUDA build of torch. The ops' schemas (argument and return types, not only names and counts) are checked when
  the kernel is built (:class:`AtenSchemaError`; ``kernel="auto"`` then falls back to ``flash``); grouped-query
  attention is passed natively where a tiny probe call shows the op takes it (:func:`probe_native_gqa`), by
  replicating KV heads elsewhere.
- ``flash``: the ``flash_attn`` package (optional extra). The forward uses its public ``flash_attn_varlen_func``;
  the backward with a given output and log-sum-exp exists only as the private ``_flash_attn_varlen_backward``,
  whose signature changed across releases (2.5: ``window_size``; 2.6: ``+ softcap``; 2.7/2.8:
  ``window_size_left, window_size_right`` as a torch custom op). It is called by parameter name, read from the
  installed function.

**Neither kernel has run on a GPU in this project** (no GPU was available): their argument building, dtype checks,
log-sum-exp layout handling and version dispatch are tested on CPU with stand-in functions of each signature.

Both return the log-sum-exp as ``[heads, tokens]`` float32; a padded ``[batch, heads, max_len]`` layout (older
flash-attn, ROCm) is converted for the merge, and converted back for the backward, which reads the layout its own
forward wrote. No kernel is ever called with an empty key set (the plan drops such segments):
flash kernels return ``lse = +inf`` there, which would break the merge.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lightning_hydra.cp.blocks import Accumulator, Segments, merge_rows, to_device, write_rows
from lightning_hydra.cp.layout import ragged_arange

__all__ = [
    "AtenSchemaError",
    "FlashAttnKernel",
    "TorchFlashKernel",
    "VarlenStep",
    "check_aten_schemas",
    "probe_native_gqa",
    "torch_version",
]

log = logging.getLogger(__name__)

_DTYPES = (torch.float16, torch.bfloat16)


def torch_version(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of ``torch.__version__`` (or of ``version``)."""
    parts = (version or torch.__version__).split("+")[0].split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


@dataclass
class VarlenStep:
    """One ring step for a variable-length kernel: row selections, boundaries and maximum lengths."""

    q_rows: torch.Tensor | None
    """Token rows of the local queries (``None``: all, in order)."""
    k_rows: torch.Tensor | None
    """Token rows of the KV block (``None``: all, in order)."""
    cu_q: torch.Tensor
    """int32 query boundaries on the device."""
    cu_k: torch.Tensor
    """int32 key boundaries on the device."""
    max_q: int
    """Longest query segment (host int: no device sync)."""
    max_k: int
    """Longest key segment."""
    causal: bool
    covers_q: bool
    covers_k: bool
    q_len: np.ndarray
    """Host query segment lengths (to unpad a padded log-sum-exp)."""
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    """Lazily built device tensors (unpad index, rng state)."""
    lse_shape: tuple[int, ...] | None = None
    """The padded ``[batch, heads, max_q]`` log-sum-exp layout this step's forward returned (``None``: packed
    ``[heads, tokens]``): the backward hands the kernel the layout its own forward returned."""

    def unpad_index(self, device: torch.device) -> torch.Tensor:
        """Index of every packed query in a ``[batch * max_q]`` padded layout."""
        idx = self.extras.get("unpad")
        if idx is None:
            starts = np.arange(self.q_len.size, dtype=np.int64) * self.max_q
            idx = self.extras["unpad"] = to_device([ragged_arange(starts, self.q_len)], device)[0]
        return idx


def _prepare(seg: Segments, device: torch.device) -> VarlenStep:
    keep = seg.keep  # segments without keys are left out: their rows keep out 0 and lse -inf
    q_len, k_len = seg.q_len[keep], seg.k_len[keep]
    q_rows = ragged_arange(seg.q_start[keep], q_len)
    k_rows = ragged_arange(seg.k_start[keep], k_len)
    all_q = q_rows.size == seg.q_rows and bool(np.all(q_rows == np.arange(seg.q_rows)))
    all_k = k_rows.size == seg.k_rows and bool(np.all(k_rows == np.arange(seg.k_rows)))
    cu_q = np.r_[0, np.cumsum(q_len)]
    cu_k = np.r_[0, np.cumsum(k_len)]
    arrays = [cu_q, cu_k] + ([] if all_q else [q_rows]) + ([] if all_k else [k_rows])
    dev = to_device(arrays, device)
    cq, ck = dev[0].to(torch.int32), dev[1].to(torch.int32)
    rest = dev[2:]
    qr = None if all_q else rest.pop(0)
    kr = None if all_k else rest.pop(0)
    return VarlenStep(qr, kr, cq, ck, int(q_len.max()), int(k_len.max()), seg.causal, seg.covers_q, seg.covers_k, q_len)


def _packed_lse(lse: torch.Tensor, step: VarlenStep) -> torch.Tensor:
    """``[heads, tokens]`` float32 log-sum-exp from ``[heads, tokens]`` or a padded ``[batch, heads, max_q]``."""
    if lse.dim() == 3:
        heads = lse.shape[1]
        lse = lse.transpose(0, 1).reshape(heads, -1).index_select(1, step.unpad_index(lse.device))
    return lse.float()


def _kernel_lse(lse: torch.Tensor, step: VarlenStep) -> torch.Tensor:
    """The packed ``[heads, tokens]`` float32 ``lse`` in the layout the step's forward returned (padded rows,
    which no kernel reads, hold 0)."""
    if step.lse_shape is None:
        return lse
    batch, heads, max_q = step.lse_shape
    padded = torch.zeros((heads, batch * max_q), dtype=lse.dtype, device=lse.device)
    padded.index_copy_(1, step.unpad_index(lse.device), lse)
    return padded.view(heads, batch, max_q).transpose(0, 1).contiguous()


class _VarlenKernel:
    """Shared row selection, merge and gradient scatter of the variable-length kernels."""

    name = "varlen"

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raise ``TypeError`` unless the kernel supports ``dtype`` (float16 or bfloat16)."""
        if dtype not in _DTYPES:
            raise TypeError(f"the {self.name} attention kernel takes {_DTYPES}, not {dtype}")

    def prepare(self, seg: Segments, *, heads: int, kv_heads: int, device: torch.device) -> VarlenStep:
        """Row selections and boundaries of one step, on ``device`` (one host-to-device copy)."""
        return _prepare(seg, device)

    def _forward(self, q, k, v, step: VarlenStep, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _backward(self, dout, q, k, v, out, lse, step: VarlenStep, scale: float):
        raise NotImplementedError

    @staticmethod
    def _select(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        return x if rows is None else x.index_select(0, rows)

    def forward(self, q, k, v, step: VarlenStep, scale: float, acc: Accumulator, first: bool) -> None:
        """One kernel call for the whole step; the first covering step writes ``acc``, later ones merge."""
        qs = self._select(q, step.q_rows)
        o, lse = self._forward(qs, self._select(k, step.k_rows), self._select(v, step.k_rows), step, scale)
        step.lse_shape = tuple(lse.shape) if lse.dim() == 3 else None
        lse_t = _packed_lse(lse, step).t()  # [tokens, heads]
        out3, lse2 = acc.out3(), acc.lse2()
        if first:
            write_rows(out3, step.q_rows, o, add=False)
            write_rows(lse2, step.q_rows, lse_t, add=False)
        else:
            merge_rows(out3, lse2, step.q_rows, o, lse_t)

    def backward(self, dout, q, k, v, out, lse, step: VarlenStep, scale: float, dq, dq_add: bool):
        """Gradients of the step given the final ``out`` and flat ``lse``; see :meth:`CpuKernel.backward`."""
        heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
        t = q.shape[0]
        lse2 = lse[: t * heads].view(t, heads)
        lse_s = _kernel_lse(self._select(lse2, step.q_rows).t().contiguous(), step)  # as the forward returned it
        gq, gk, gv = self._backward(
            self._select(dout, step.q_rows),
            self._select(q, step.q_rows),
            self._select(k, step.k_rows),
            self._select(v, step.k_rows),
            self._select(out, step.q_rows),
            lse_s,
            step,
            scale,
        )
        write_rows(dq[: t * heads].view(t, heads, dim), step.q_rows, gq, add=dq_add)
        tk = k.shape[0]

        def apply(dk: torch.Tensor, dv: torch.Tensor, add: bool) -> None:
            write_rows(dk[: tk * kv_heads].view(tk, kv_heads, dim), step.k_rows, gk, add)
            write_rows(dv[: tk * kv_heads].view(tk, kv_heads, dim), step.k_rows, gv, add)

        return apply


_FWD_KINDS = ("tensor",) * 5 + ("int", "int", "float", "bool", "bool")
"""query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask."""
_BWD_KINDS = ("tensor",) * 8 + ("int", "int", "float", "bool", "tensor", "tensor")
"""grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
rng_state (philox_seed before 2.6), unused (philox_offset)."""


def _kind(type_: Any) -> str:
    """``tensor``, ``int``, ``float``, ``bool`` or the type's own name, for a schema argument's type (optional
    types as their element: this kernel passes a value)."""
    name = str(type_)
    if name.startswith("Optional[") and name.endswith("]"):
        name = name[len("Optional[") : -1]
    return {"Tensor": "tensor", "SymInt": "int", "int": "int", "float": "float", "bool": "bool"}.get(name, name)


class AtenSchemaError(RuntimeError):
    """The aten flash ops' schemas are not those :class:`TorchFlashKernel` calls (one-line message naming the op,
    what the kernel expects and what the op has)."""


def _describe(positional: tuple[str, ...], keywords: list[str], outputs: list[str]) -> str:
    return f"({', '.join(positional)}; *, {', '.join(keywords)}) -> ({', '.join(outputs)})"


def check_aten_schemas(forward_schema: Any, backward_schema: Any) -> None:
    """Raise :class:`AtenSchemaError` (one line) unless the aten flash ops take the arguments
    :class:`TorchFlashKernel` passes: the types of the positional prefix (10 forward, 14 backward arguments; names
    changed across releases: ``philox_seed, philox_offset`` became ``rng_state, unused``), a keyword ``scale`` that
    takes a float, no other required keyword, and at least two (forward) or three (backward) tensors returned.
    """
    for schema, kinds, returns in ((forward_schema, _FWD_KINDS, 2), (backward_schema, _BWD_KINDS, 3)):
        positional = [a for a in schema.arguments if not a.kwarg_only]
        keywords = {a.name: a for a in schema.arguments if a.kwarg_only}
        got = tuple(_kind(a.type) for a in positional)
        required = [n for n, a in keywords.items() if n != "scale" and not a.has_default_value()]
        outputs = [_kind(r.type) for r in schema.returns]
        if (
            got != kinds
            or "scale" not in keywords
            or _kind(keywords["scale"].type) != "float"
            or required
            or outputs[:returns] != ["tensor"] * returns
        ):
            expected = _describe(kinds, ["scale: float"], ["tensor"] * returns + ["..."])
            found = _describe(got, [f"{n}: {_kind(a.type)}" for n, a in keywords.items()], outputs)
            raise AtenSchemaError(
                f"torch {torch.__version__}: the aten flash op {schema.name} has an unsupported signature {found}; "
                f"the 'torch' attention kernel expects {expected} (as in torch 2.4-2.13)"
            )


def probe_native_gqa(forward_op: Callable[..., Any], device: torch.device) -> bool:
    """Whether ``forward_op`` accepts fewer KV heads than query heads: one tiny call (2 tokens, 2 query heads, 1 KV
    head, float16) on ``device``; an op that refuses it raises at once, before any kernel runs."""
    q = torch.zeros((2, 2, 8), dtype=torch.float16, device=device)
    kv = torch.zeros((2, 1, 8), dtype=torch.float16, device=device)
    cu = torch.tensor([0, 2], dtype=torch.int32, device=device)
    try:
        out = forward_op(q, kv, kv, cu, cu, 2, 2, 0.0, True, False, scale=1.0)[0]
    except (RuntimeError, ValueError, AssertionError) as error:
        log.info("the aten flash op takes no grouped KV heads here (%s): KV heads are replicated", error)
        return False
    return tuple(out.shape) == tuple(q.shape)


class TorchFlashKernel(_VarlenKernel):
    """PyTorch's packed variable-length flash attention (CUDA). **Not yet run on a GPU** (see the module docstring).

    Args:
        forward_op: The forward op (default ``torch.ops.aten._flash_attention_forward``); injectable for tests.
        backward_op: The backward op (default ``torch.ops.aten._flash_attention_backward``).
        native_gqa: Pass fewer KV heads than query heads to the op (default: probed by :func:`probe_native_gqa`
            on the first call's device, whatever the torch version).

    Raises:
        AtenSchemaError: The default ops' schemas are not those this kernel calls.
    """

    name = "torch"

    def __init__(
        self,
        forward_op: Callable[..., Any] | None = None,
        backward_op: Callable[..., Any] | None = None,
        native_gqa: bool | None = None,
    ) -> None:
        if forward_op is None or backward_op is None:
            fwd = torch.ops.aten._flash_attention_forward
            bwd = torch.ops.aten._flash_attention_backward
            check_aten_schemas(fwd.default._schema, bwd.default._schema)
            forward_op, backward_op = fwd, bwd
        self._fwd, self._bwd = forward_op, backward_op
        self.native_gqa = native_gqa
        """Whether the op takes fewer KV heads than query heads (``None``: not probed yet)."""

    def _kv(self, k: torch.Tensor, heads: int) -> torch.Tensor:
        group = heads // k.shape[1]
        if group == 1:
            return k
        if self.native_gqa is None:
            self.native_gqa = probe_native_gqa(self._fwd, k.device)
        return k if self.native_gqa else k.repeat_interleave(group, dim=1)

    def _forward(self, q, k, v, step: VarlenStep, scale: float):
        heads = q.shape[1]
        out, lse, *_ = self._fwd(
            q, self._kv(k, heads), self._kv(v, heads), step.cu_q, step.cu_k, step.max_q, step.max_k, 0.0,
            step.causal, False, scale=scale,
        )  # fmt: skip
        return out, lse

    def _backward(self, dout, q, k, v, out, lse, step: VarlenStep, scale: float):
        heads, kv_heads = q.shape[1], k.shape[1]
        rng = step.extras.get("rng")
        if rng is None:  # unused without dropout; what torch's own varlen_attn passes
            rng = step.extras["rng"] = torch.zeros((2,), dtype=torch.uint64, device=q.device)
            step.extras["unused"] = torch.empty((0,), device=q.device)
        gq, gk, gv = self._bwd(
            dout, q, self._kv(k, heads), self._kv(v, heads), out, lse, step.cu_q, step.cu_k, step.max_q,
            step.max_k, 0.0, step.causal, rng, step.extras["unused"], scale=scale,
        )  # fmt: skip
        if gk.shape[1] != kv_heads:  # replicated KV heads: sum the replicas' gradients
            group = heads // kv_heads
            gk = gk.view(gk.shape[0], kv_heads, group, -1).sum(2)
            gv = gv.view(gv.shape[0], kv_heads, group, -1).sum(2)
        return gq, gk, gv


_FLASH_NAMES = {
    "dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k",
    "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale", "causal", "window_size", "window_size_left",
    "window_size_right", "softcap", "alibi_slopes", "deterministic", "rng_state",
}  # fmt: skip


def backward_parameters(fn: Callable[..., Any]) -> tuple[str, ...]:
    """Parameter names of flash-attn's ``_flash_attn_varlen_backward`` (a function or a torch custom op).

    Raises:
        RuntimeError: A required parameter this kernel does not know how to fill.
    """
    sig = inspect.signature(getattr(fn, "_init_fn", fn))
    unknown = [
        name for name, p in sig.parameters.items() if name not in _FLASH_NAMES and p.default is inspect.Parameter.empty
    ]
    if unknown:
        raise RuntimeError(f"unsupported flash-attn backward signature {sig}: unknown parameters {unknown}")
    return tuple(name for name in sig.parameters if name in _FLASH_NAMES)


class FlashAttnKernel(_VarlenKernel):
    """flash-attn's varlen kernels (CUDA), flash-attn 2.5-2.8. **Not yet run on a GPU** (see the module docstring).

    Args:
        interface: The ``flash_attn.flash_attn_interface`` module (default: imported); injectable for tests.
        version: Its version string (default ``flash_attn.__version__``).
    """

    name = "flash"

    def __init__(self, interface: Any | None = None, version: str | None = None) -> None:
        if interface is None:
            import flash_attn
            from flash_attn import flash_attn_interface

            interface, version = flash_attn_interface, flash_attn.__version__
        major_minor = torch_version(version or "0.0")
        if major_minor < (2, 5):
            raise RuntimeError(f"flash-attn {version} is too old for the 'flash' kernel: install flash-attn>=2.5")
        self.version = version
        self._fwd = interface.flash_attn_varlen_func
        self._bwd = interface._flash_attn_varlen_backward
        self._bwd_names = backward_parameters(self._bwd)

    def _forward(self, q, k, v, step: VarlenStep, scale: float):
        out, lse, _ = self._fwd(
            q, k, v, step.cu_q, step.cu_k, step.max_q, step.max_k, dropout_p=0.0, softmax_scale=scale,
            causal=step.causal, return_attn_probs=True,
        )  # fmt: skip
        return out, lse

    def _backward(self, dout, q, k, v, out, lse, step: VarlenStep, scale: float):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        values = {
            "dout": dout.contiguous(), "q": q, "k": k, "v": v, "out": out.contiguous(), "softmax_lse": lse,
            "dq": dq, "dk": dk, "dv": dv, "cu_seqlens_q": step.cu_q, "cu_seqlens_k": step.cu_k,
            "max_seqlen_q": step.max_q, "max_seqlen_k": step.max_k, "dropout_p": 0.0, "softmax_scale": scale,
            "causal": step.causal, "window_size": (-1, -1), "window_size_left": -1, "window_size_right": -1,
            "softcap": 0.0, "alibi_slopes": None, "deterministic": False, "rng_state": None,
        }  # fmt: skip
        self._bwd(**{name: values[name] for name in self._bwd_names})
        return dq, dk, dv
