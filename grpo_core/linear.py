"""The fused linear GRPO loss: from the last hidden states and the lm_head weight, never the `[B, T, V]` logits.

    result = linear_grpo_loss(hidden, weight, action_ids, old_logps, rewards, completion_mask, beta=0.04,
                              samples_per_prompt=4, ref_logps=ref_logps)       # loss, policy_loss, kl = result
    result = LinearGRPOLossOp().apply(hidden, weight, ..., contract=contract, tp_group=..., dp_group=...)
    logp = linear_logprobs(hidden, weight, action_ids, completion_mask)        # the loss's own log-probs

This rank's active tokens go through in chunks of a fixed number of tokens. Per chunk, once: the logits
`z = h W^T (+ b)` in fp32 (a `[chunk, local vocab]` buffer, the only one that scales with the vocabulary), the
canonical tile statistics and log-sum-exp of `vocab_parallel_logprob.py` (gathered over TP), the log-probs, and,
when a gradient is wanted, `dz = coef * (onehot - softmax)` (`canonical.token_coef`, the advantages and the
normalizer's token weights being known before the pass), cast to the weight's dtype a slice of vocabulary columns at
a time (`SLICE_COLUMNS`; over TP the rank's whole shard), each slice then folded into `dH += dz W` and `dW += dz^T h`
(and the bias' column sums). The logits that no gradient reads (the reference's, `linear_logprobs`', the first pass
of the four-matmul options below) are never stored by the Triton kernels where a tile fits the matmul's output tile
(a power of two up to 256 columns; the default is 128): the matmul's epilogue computes their tile statistics from its
accumulator (`triton/matmul.py`'s `matmul_stats`, the row kernel's bits over the stored logits), the chunk's whole
row of vocabulary in one launch.
Three matmuls per token, nothing recomputed (GSPO's `importance_sampling_level="sequence"`, the off-policy mask and
vespo: four, the logits computed twice, since a token's coefficient needs every log-prob of its sequence; the first
pass computes only the log-probs); the gradients are ready when the forward returns and are scaled by `grad_output`
in the backward (exact when it is 1.0, as after `loss.backward()`: `dH` is kept in the hidden states' dtype, `dW` in
fp32 until then).

The per-token log-probs then give the loss exactly as the logits op's deterministic path does: the same stages
(`distributed/grpo_loss.py`: the advantages, the token terms with `pair_sum` over `padded_seq_len`, per-sequence
vectors gathered over DP, the finish with the normalizer, the checks, the gradient's coefficients, the result), by
the same kernels: with the Triton kernel set the advantages, the token terms and the finish are a launch each.
Every sum has a shape fixed by the contract:
- a logit is a dot over H by the kernels' one fixed order, the same for any token, batch, chunk and shard;
- vocabulary statistics: the canonical tiles, merged in global tile order over TP;
- `dH`, a sum over the vocabulary: a left fold over the vocabulary in fixed steps, started from 0.0 on TP rank 0
  and continued by each TP rank from the previous rank's partial sum (it travels by `broadcast`, exactly): the
  same bits at every TP degree;
- `dW`, a sum over this rank's active tokens: a left fold in token order, in fixed steps (TP never changes a rank's
  tokens, so its rows are the same bits at every TP degree; DP changes the tokens, and summing the DP ranks' `dW`
  is the trainer's gradient reduction);
- the bias gradient: per chunk a `pair_sum` over the chunk's tokens, folded over the chunks.

Two kernel sets compute that:
- "torch" (any device; the CPU reference): each logit, each `dH` step of a vocabulary tile and each `dW` step of a
  token block is a `canonical.pair_sum` of fp32 products (exact for bf16 inputs); IEEE `*` and `+` only, so the
  bits are the same on every CPU and GPU (the portable golden);
- "triton" (CUDA, or the interpreter): `triton/matmul.py`'s one fixed-configuration matmul on the tensor cores and
  the row kernels of `triton/canonical.py`; the tensor cores' accumulation has no IEEE definition, so these bits
  are per GPU architecture (an sm_90 golden), still the same at every layout, batch and position.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import canonical, pending
from .checks import check_inputs, check_logprobs, check_option_inputs, check_tensor, stand_in
from .contract import (DEFAULT_VOCAB_TILE, AdvantagesInput, GRPOLossContract, LogprobContract, LossContractError,
                       Surrogate, check_temperature, inverse_temperature)
from .digest import row_digests
from .distributed.grpo_loss import (LossCall, _TorchKernels, _TritonKernels, advantages_stage, loss_coef,
                                    replicated_inputs, result_stage)
from .distributed.preflight import preflight
from .distributed.vocab_parallel_logprob import gather_tile_stats, local_tile_stats, write_grad
from .result import GRPOLossResult, provenance

__all__ = ["LinearGRPOLossOp", "linear_grpo_loss", "linear_logprobs"]

BACKEND_ID = "linear/1"
TORCH_CHUNK = 256  # tokens per chunk of the torch kernels (the dW fold's step)
TRITON_CHUNK = 4096  # tokens per chunk of the Triton kernels, a multiple of the matmul's K step: an fp32 [4096, V]
# logits buffer (2.5 GB at V = 151936). No bit depends on it (dW's fold continues across chunks on K-step
# boundaries); 2048 halves the buffer but reads and writes the fp32 dW accumulator twice as often (4.4 GB a chunk
# at H = 3584)
SLICE_COLUMNS = 32768  # the most vocabulary columns of a chunk's dz buffer at TP = 1 (256 MiB in bf16 at 4096 tokens;
# over TP, dz is the rank's whole shard), and of its logits when they are stored but not kept for dz (the
# reference's, and without gradients: by the torch kernels, or for tiles wider than `matmul_stats` takes). No bit
# depends on it (`_slices`); at V = 151936 a whole dz took 1.2 GB, whole logits 2.5 GB
MIN_TRITON_TILE = 16  # the dH matmul steps over the vocabulary by min(tile, 64) columns (tl.dot: K >= 16)
MAX_TRITON_TILE = 4096  # the row kernels' largest tile
_PRODUCTS = 1 << 22  # fp32 products per step of the torch kernels' dots
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`[n, m]` fp32: each element the `pair_sum` over K of the fp32 products `a[i, k] * b[j, k]` (`a` `[n, K]`,
    `b` `[m, K]`), in slices of about `_PRODUCTS` products (slicing never changes a bit)."""
    a, b = a.float(), b.float()
    (n, K), m = a.shape, b.shape[0]
    out = torch.empty((n, m), dtype=torch.float32, device=a.device)
    cols = max(1, min(m, _PRODUCTS // max(K, 1)))
    rows = max(1, _PRODUCTS // (cols * max(K, 1)))
    for j in range(0, m, cols):
        for i in range(0, n, rows):
            out[i:i + rows, j:j + cols] = canonical.pair_sum(a[i:i + rows, None, :] * b[None, j:j + cols, :])
    return out


class TorchKernels:
    """The portable reference: IEEE `*` and `+` in fixed trees (see the module docstring)."""

    name, chunk = "torch", TORCH_CHUNK

    def logits(self, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        z = _dot(h, w)
        return z if b is None else z + b.float()

    @staticmethod
    def stats(z, ids, lo, width, inv, entropy: bool = False) -> tuple[torch.Tensor, ...]:
        """`(m, s, selected(, u))` of `z`, the vocabulary's columns from `lo` (`local_tile_stats`)."""
        return local_tile_stats(z, torch.arange(z.shape[0], device=z.device), ids, lo, width, inv, entropy)

    def logit_stats(self, h, w, b, ids, lo, width, inv, entropy: bool = False) -> tuple[torch.Tensor, ...]:
        """`stats` of the logits of `h` and the rows of `w` (and `b`), not kept."""
        return self.stats(self.logits(h, w, b), ids, lo, width, inv, entropy)

    @staticmethod
    def logit_slices(V: int, width: int) -> list[tuple[int, int]]:
        """The column slices `logit_stats` takes of a chunk's `V` columns: stored logits, `_slices`."""
        return _slices(V, width)

    @staticmethod
    def merge(m, s, *u) -> tuple[torch.Tensor, ...]:
        """`(lse,)`, or with the entropy's tile sums `u`, `(lse, entropy)`: every tile merged in order."""
        merged = canonical.merge_stats(m, s, *u)
        return (canonical.lse(*merged[:2]), *([canonical.entropy_of(*merged)] if u else []))

    def dz(self, z, ids, lo, lse, logp, c: _CoefInputs, inv, dtype) -> torch.Tensor:
        if c.coef is not None:
            coef = c.coef.unsqueeze(1)
        else:
            lo_t, hi_t = canonical.fp32(c.clip_lo, z), canonical.fp32(c.clip_hi, z)
            one = torch.ones_like(logp, dtype=torch.bool).unsqueeze(1)
            ratio, _ = canonical.ratio_and_kl(logp.unsqueeze(1), None, c.old.unsqueeze(1), one)
            coef = canonical.token_coef(ratio, logp.unsqueeze(1), None if c.ref is None else c.ref.unsqueeze(1),
                                        c.adv, c.w, one, lo_t, hi_t, c.beta, c.delta,
                                        None if c.is_ratio is None else c.is_ratio.unsqueeze(1), c.bias_kl,
                                        c.surrogate, c.taus)
        if inv != 1.0:
            coef = coef * canonical.fp32(inv, coef)
        entropy = None
        if c.coef_h is not None:
            entropy = (c.coef_h if inv == 1.0 else c.coef_h * canonical.fp32(inv, c.coef_h), c.ent)
        out = torch.empty(z.shape, dtype=dtype, device=z.device)
        write_grad(out, z, torch.arange(z.shape[0], device=z.device), ids - lo, lse, coef[:, 0], z.shape[1], inv,
                   entropy)
        return out

    @staticmethod
    def fold_step(width: int) -> int:
        """The columns of one step of `dhidden`'s fold over the vocabulary."""
        return width

    def dhidden(self, dz: torch.Tensor, w: torch.Tensor, acc: torch.Tensor, width: int) -> torch.Tensor:
        for start in range(0, dz.shape[1], width):
            acc = acc + _dot(dz[:, start:start + width], w[start:start + width].T)
        return acc

    def dweight(self, dz: torch.Tensor, h: torch.Tensor, acc: torch.Tensor, first: bool) -> None:
        """`acc += dz^T h`; `first`: `acc` is uninitialized, the fold starts from 0.0."""
        if first:
            acc.zero_()
        acc += _dot(dz.T, h.T)

    @staticmethod
    def scale(t: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`t * g` (fp32 `g` `[]`) rounded once to `dtype`: in place when `t` has it."""
        return t.mul_(g) if t.dtype == dtype else torch.mul(t, g, out=torch.empty_like(t, dtype=dtype))


class TritonKernels:
    """Tensor cores: `triton/matmul.py` and the row kernels of `triton/canonical.py`."""

    name, chunk = "triton", TRITON_CHUNK

    def __init__(self) -> None:
        from .triton import canonical as rows, matmul
        self.rows, self.mm = rows, matmul.matmul
        self.mm_stats, self.stats_fit, self.cast = matmul.matmul_stats, matmul.stats_fit, matmul.scaled_cast

    def logits(self, h, w, b):  # rows padded to 8 columns: 16-byte aligned, the row kernel's aligned loads
        V = w.shape[0]
        z = torch.empty((h.shape[0], -(-V // 8) * 8), dtype=torch.float32, device=h.device)[:, :V]
        return self.mm(h, w.T, z, bias=b, tma=False)  # pointer loads: faster than TMA here (matmul.py's A/B)

    def stats(self, z, ids, lo, width, inv, entropy: bool = False):
        mask = torch.ones(z.shape[0], dtype=torch.bool, device=z.device)
        sel, stats = self.rows.row_stats(z, None, ids, mask, lo, width, inv, entropy)
        return stats[0, 0], stats[0, 1], sel[0], *stats[0, 2:]

    def logit_stats(self, h, w, b, ids, lo, width, inv, entropy: bool = False):
        """`stats` of the logits of `h` and the rows of `w` (and `b`): from the matmul's accumulator where the tile
        fits its output tile (`matmul.matmul_stats`, the same bits, the logits never stored), else stored first.
        (Where `dz` reads the logits, storing them from the same kernel took longer than the row kernel's pass:
        H100, 4096 x 3584 x 32768, 2.06 ms against 1.75.)"""
        if not self.stats_fit(width):
            return self.stats(self.logits(h, w, b), ids, lo, width, inv, entropy)
        return self.mm_stats(h, w.T, ids, lo, width, inv, entropy, bias=b)

    def logit_slices(self, V, width):
        """The whole row in one launch where the epilogue takes the tiles (nothing stored), else `_slices`."""
        return [(0, V)] if self.stats_fit(width) else _slices(V, width)

    def merge(self, m, s, *u):
        mask = torch.ones(m.shape[0], dtype=torch.bool, device=m.device)
        if not u:
            return (self.rows.merge_lse(torch.stack([m, s])[None], mask)[0],)
        lse, ent = self.rows.merge_lse(torch.stack([m, s, u[0]])[None], mask, True)
        return lse[0], ent

    def dz(self, z, ids, lo, lse, logp, c: _CoefInputs, inv, dtype):
        """Into a buffer of its own (rows padded to 8 columns for TMA). Not over `z`'s own rows: a row's threads
        write columns whose bytes other threads of the row have not read yet (the H200 showed it: a run-to-run test
        moved 4 bits of dH)."""
        mask = torch.ones(z.shape[0], dtype=torch.bool, device=z.device)
        one = torch.ones(1, dtype=torch.float32, device=z.device)
        V = z.shape[1]
        out = torch.empty((z.shape[0], -(-V // 8) * 8), dtype=dtype, device=z.device)[:, :V]
        return self.rows.grad(z, ids, mask.unsqueeze(1), logp, c.ref, c.old, c.adv, c.w, lse, one, lo, c.clip_lo,
                              c.clip_hi, c.beta, inv, out=out, delta=c.delta, is_ratio=c.is_ratio, bias_kl=c.bias_kl,
                              surrogate=c.surrogate, taus=c.taus, coef=c.coef,
                              entropy=None if c.coef_h is None else (c.coef_h, c.ent))

    @staticmethod
    def fold_step(width: int) -> int:  # TP shards start on tiles: a K step that divides the tile width
        return min(width, 64)

    def dhidden(self, dz, w, acc, width):
        return self.mm(dz, w, acc, accumulate=True, block_k=self.fold_step(width))

    def dweight(self, dz, h, acc, first):  # the first writes: the accumulator starts from 0.0 in the kernel
        self.mm(dz.T, h, acc, accumulate=not first)

    def scale(self, t, g, dtype):
        return self.cast(t, g, dtype) if t.dtype != dtype else t.mul_(g)


def _check_kernels(choice: Any) -> str:
    if choice not in ("auto", "triton", "torch"):
        raise LossContractError(f"kernels: expected 'auto', 'triton' or 'torch', got {choice!r}")
    return choice


def _kernels(choice: str, device: torch.device, width: int) -> TorchKernels | TritonKernels:
    """The kernel set `choice` names ('auto': Triton for CUDA tensors when it imports and takes tiles of `width`)."""
    _check_kernels(choice)
    has_triton = importlib.util.find_spec("triton") is not None
    fits = MIN_TRITON_TILE <= width <= MAX_TRITON_TILE
    if choice == "torch" or (choice == "auto" and not (device.type == "cuda" and has_triton and fits)):
        return TorchKernels()
    if not has_triton:
        raise LossContractError("kernels: 'triton' needs the triton package (pip install '.[triton]'); use "
                                "kernels='torch'")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise LossContractError(f"kernels: 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU "
                                f"interpreter), got hidden on {device}; use kernels='torch'")
    if not fits:
        raise LossContractError(f"vocab_tile: the Triton kernels take tiles of {MIN_TRITON_TILE} to {MAX_TRITON_TILE} "
                                f"columns, got {width}; use kernels='torch'")
    return TritonKernels()


def _fold_over_tp(local: Callable[[torch.Tensor], torch.Tensor], start: torch.Tensor, lp: LogprobContract,
                  tp_group: Any) -> torch.Tensor:
    """`local(partial)` continued rank after rank in TP order from `start` (zeros): TP rank r receives rank r - 1's
    partial sum by `broadcast` (an exact copy), continues it over its shard and sends it on; every rank returns the
    last rank's. One rank: `local(start)`."""
    tp = len(lp.vocab_shard_bounds)
    if tp == 1:
        return local(start)
    group = tp_group if tp_group is not None else dist.group.WORLD
    acc = start
    for r in range(tp):
        if r == lp.tp_rank:
            acc = local(acc).contiguous()
        dist.broadcast(acc, src=dist.get_global_rank(group, r), group=tp_group)
    return acc


def _run_chunks(k, hidden, weight, bias, ids, rows, lp: LogprobContract, tp_group, inv, grads=None, ref=None,
                entropy: bool = False):
    """The chunk loop over this rank's active tokens `rows` (flat indices into `hidden` `[tokens, H]`): returns
    `(logp, logp_ref, ent)` fp32 `[len(rows)]` (`logp_ref` None without `ref = (ref_hidden, ref_weight, ref_bias)`;
    `ent`, the policy's entropies, None without `entropy`).
    `grads`: `(inputs, dh, dw, db)`, the `_CoefInputs` of the rows and the gradients to fill as it goes (`dh`
    `[tokens, H]` in hidden's dtype, zeros; `dw` fp32 `[V_local, H]`, uninitialized: the first chunk writes it; `db`
    fp32 `[V_local]`, zeros; each None when not wanted)."""
    n, V = rows.numel(), weight.shape[0]
    if grads is not None and grads[2] is not None and n == 0:  # no chunk writes dW
        grads[2].zero_()
    logp = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    logp_ref = None if ref is None else torch.zeros_like(logp)
    ent = torch.zeros_like(logp) if entropy else None
    lo, slices = lp.local_bounds[0], k.logit_slices(V, lp.tile_width)
    for start in range(0, n, k.chunk):
        stop = min(n, start + k.chunk)
        r, a = rows[start:stop], ids[start:stop]
        if ref is not None:  # the reference's logits a slice at a time, before the policy's
            lse_ref, sel_ref = _lse(k, _sliced_stats(k, ref[0][r], ref[1], ref[2], a, lp, inv), slices, a, lp,
                                    tp_group)
            logp_ref[start:stop] = sel_ref - lse_ref
        h = hidden[r]
        if grads is None:  # the policy's too
            lse, sel, *chunk_ent = _lse(k, _sliced_stats(k, h, weight, bias, a, lp, inv, entropy), slices, a, lp,
                                        tp_group, entropy)
        else:  # dz reads the whole chunk's logits
            z = k.logits(h, weight, bias)
            lse, sel, *chunk_ent = _lse(k, lambda u, v, z=z: k.stats(z, a, lo, lp.tile_width, inv, entropy), [(0, V)],
                                        a, lp, tp_group, entropy)
        logp[start:stop] = sel - lse
        if entropy:
            ent[start:stop] = chunk_ent[0]
        if grads is None:
            continue
        inputs, dh, dw, db = grads
        c = inputs.chunk(start, stop, logp, logp_ref)
        acc = None if dh is None else torch.zeros((stop - start, hidden.shape[1]), dtype=torch.float32,
                                                  device=hidden.device)
        # Over TP one slice, the shard: each rank continues the previous rank's fold over its whole shard.
        for u, v in _slices(V, k.fold_step(lp.tile_width)) if len(lp.vocab_shard_bounds) == 1 else [(0, V)]:
            dz = k.dz(z[:, u:v], a, lo + u, lse, logp[start:stop], c, inv, weight.dtype)
            if dh is not None:
                acc = _fold_over_tp(lambda acc, dz=dz, w=weight[u:v]: k.dhidden(dz, w, acc, lp.tile_width), acc, lp,
                                    tp_group)
            if dw is not None:
                k.dweight(dz, h, dw[u:v], start == 0)
            if db is not None:
                db[u:v] += canonical.pair_sum(dz.float(), 0)
            del dz
        del z
        if dh is not None:
            dh[r] = acc.to(dh.dtype)
    return logp, logp_ref, ent


def _slices(V: int, step: int) -> list[tuple[int, int]]:
    """`V` columns in slices of `SLICE_COLUMNS` at most (one `step` where a step is wider), each but the last a whole
    number of `step`s: for `dz`, of the `dH` fold's steps (the fold continued from slice to slice is the fold over
    the whole row: `triton/matmul.py`); for the logits, of tiles (a tile's statistics are of its own columns alone)."""
    width = max(step, SLICE_COLUMNS // step * step)
    return [(u, min(V, u + width)) for u in range(0, V, width)]


def _lse(k, stats_of, slices: list[tuple[int, int]], ids: torch.Tensor, lp: LogprobContract, tp_group,
         entropy: bool = False) -> tuple[torch.Tensor, ...]:
    """`(lse, selected logit(, entropy))` of a chunk's rows from `stats_of(u, v)`, the `(m, s, selected(, u))` of
    this rank's columns `[u, v)` for each of `slices` (whole tiles; each slice's logits gone before the next are
    made), every rank's gathered over TP, merged in global tile order. The same bits in any slices."""
    parts, sel = [], None
    for u, v in slices:
        m, s, got, *e = stats_of(u, v)
        local = ids - (lp.local_bounds[0] + u)
        sel = got if sel is None else torch.where((local >= 0) & (local < v - u), got, sel)
        parts.append((m, s, *e))
    m, s, *e = (p[0] if len(p) == 1 else torch.cat(p, 1) for p in zip(*parts))
    m, s, sel, *e = gather_tile_stats(m, s, sel, ids, lp, tp_group, *e)
    lse, *ent = k.merge(m, s, *e)
    return lse, sel, *ent


def _sliced_stats(k, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                  lp: LogprobContract, inv: float, entropy: bool = False):
    """`(u, v) -> ` the statistics of the logits of columns `[u, v)` (a logit's bits are its row's and its column's
    alone), the logits not kept."""
    lo = lp.local_bounds[0]
    return lambda u, v: k.logit_stats(h, weight[u:v], None if bias is None else bias[u:v], ids, lo + u,
                                      lp.tile_width, inv, entropy)


@dataclasses.dataclass
class _CoefInputs:
    """What `dz` needs per active token besides the log-probs (fp32 `[n]` each) and the options."""

    old: torch.Tensor | None
    adv: torch.Tensor
    w: torch.Tensor
    ref: torch.Tensor | None
    is_ratio: torch.Tensor | None
    clip_lo: float
    clip_hi: float
    beta: float
    delta: float | None
    bias_kl: bool
    surrogate: Surrogate
    taus: tuple[float, float] | None
    coef: torch.Tensor | None = None  # GSPO: each token's weighted `d loss / d logp`, computed before the pass
    coef_h: torch.Tensor | None = None  # the entropy bonus: each token's weight in it (`canonical.entropy_bonus`)
    ent: torch.Tensor | None = None  # with `coef_h`: each token's entropy

    def chunk(self, start: int, stop: int, logp: torch.Tensor, logp_ref: torch.Tensor | None) -> _CoefInputs:
        """The chunk's tokens' inputs: the old log-probs (the policy's own `logp` when None: on-policy) and the
        reference's (`logp_ref` computed by the loop, or given)."""
        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[start:stop]

        return dataclasses.replace(self, old=cut(logp if self.old is None else self.old), adv=cut(self.adv),
                                   w=cut(self.w), ref=cut(logp_ref if logp_ref is not None else self.ref),
                                   is_ratio=cut(self.is_ratio), coef=cut(self.coef), coef_h=cut(self.coef_h),
                                   ent=cut(self.ent))


class _Grads(torch.autograd.Function):
    """Forward: the loss, computed outside autograd with its gradients. Backward: those gradients times
    `grad_output` (in fp32, rounded once to each input's dtype: the stored gradient itself when it is 1.0). It runs
    once: the kernel set's `scale` scales each stored gradient (in place where it has its input's dtype, else into a
    new tensor of it in one pass) and hands it over."""

    @staticmethod
    def forward(ctx, loss, hidden, weight, bias, grads, scale):
        ctx.grads, ctx.scale = grads, scale
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError("the fused linear loss's backward runs once (its gradients are computed in the forward "
                               "and handed over): call the loss again for another backward")
        g = grad_loss.to(torch.float32)
        out = [None if t is None else ctx.scale(t, g, dtype) for t, dtype in ctx.grads]  # the kernels' `scale`
        ctx.grads = None
        return None, *out, None, None


def _check_linear(hidden, weight, bias, ref_logps, ref_hidden, ref_weight, ref_bias, old_logps, n: int, T: int,
                  vocab_local: int | None, beta: float) -> None:
    """Types, shapes, dtypes and devices of the hidden-state arguments (the rest is `check_inputs`'s)."""
    check_tensor("hidden", hidden)
    check_tensor("weight", weight)
    for name, t in (("bias", bias), ("ref_logps", ref_logps), ("ref_hidden", ref_hidden), ("ref_weight", ref_weight),
                    ("ref_bias", ref_bias), ("old_logps", old_logps)):
        check_tensor(name, t, optional=True)
    if hidden.dim() != 3 or hidden.shape[:2] != (n, T):
        raise LossContractError(f"hidden: expected a 3-D tensor [B, T, H] with [B, T] = {[n, T]}, got "
                                f"{list(hidden.shape)}")
    H = hidden.shape[2]
    if hidden.dtype not in _FLOAT_DTYPES:
        raise LossContractError(f"hidden: expected dtype float32, float16 or bfloat16, got {hidden.dtype}")
    if H == 0:
        raise LossContractError(f"hidden: expected a hidden size H >= 1, got shape {list(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != H or weight.shape[0] < 1:
        raise LossContractError(f"weight: expected [V, H] with H = {H} like hidden's last dim, got "
                                f"{list(weight.shape)}")
    rows = weight.shape[0]
    if vocab_local is not None and rows != vocab_local:
        raise LossContractError(f"weight: expected {vocab_local} rows (this rank's vocabulary shard, from the "
                                f"contract), got {list(weight.shape)}")
    pairs = [("weight", weight, hidden, "hidden")]
    if bias is not None:
        pairs.append(("bias", bias, hidden, "hidden"))
        if bias.shape != (rows,):
            raise LossContractError(f"bias: expected shape [V] = [{rows}] like weight's rows, got {list(bias.shape)}")
    if ref_logps is not None and ref_hidden is not None:
        raise LossContractError("ref_logps / ref_hidden: expected at most one of them (given reference log-probs, or "
                                "the reference model's hidden states), got both")
    if beta != 0.0 and ref_logps is None and ref_hidden is None:
        raise LossContractError(f"ref_logps / ref_hidden: one is required when beta > 0 (beta={beta}): pass the "
                                f"reference log-probs [B, T] or the reference hidden states [B, T, H], or set beta=0")
    if ref_hidden is None and (ref_weight is not None or ref_bias is not None):
        raise LossContractError("ref_weight / ref_bias: only used with ref_hidden, which is None")
    if ref_logps is not None:  # its shape, dtype and values: `check_inputs`'s, the logits ops' words
        pairs.append(("ref_logps", ref_logps, hidden, "hidden"))
    if ref_hidden is not None:
        if ref_hidden.shape != hidden.shape:
            raise LossContractError(f"ref_hidden: expected shape {list(hidden.shape)} like hidden, got "
                                    f"{list(ref_hidden.shape)}")
        rw = weight if ref_weight is None else ref_weight
        if rw.shape != weight.shape:
            raise LossContractError(f"ref_weight: expected shape {list(weight.shape)} like weight, got "
                                    f"{list(rw.shape)}")
        pairs += [("ref_hidden", ref_hidden, hidden, "hidden"), ("ref_weight", rw, ref_hidden, "ref_hidden")]
        if ref_bias is not None:
            if ref_bias.shape != (rows,):
                raise LossContractError(f"ref_bias: expected shape [{rows}] like weight's rows, got "
                                        f"{list(ref_bias.shape)}")
            pairs.append(("ref_bias", ref_bias, ref_hidden, "ref_hidden"))
    for name, t, like, like_name in pairs:
        if t.device != hidden.device:
            raise LossContractError(f"{name}: expected device {hidden.device} like hidden, got {t.device}")
        if name != "ref_logps" and t.dtype != like.dtype:
            raise LossContractError(f"{name}: expected dtype {like.dtype} like {like_name} (one matmul dtype), got "
                                    f"{t.dtype}")


class LinearGRPOLossOp:
    """`result = op.apply(hidden, weight, action_ids, old_logps, rewards, contract=..., completion_mask=...,
    bias=None, ref_logps=None, ref_hidden=None, ref_weight=None, ref_bias=None, advantages=None, tp_group=None,
    dp_group=None)`: the contract path of the fused linear loss, for vocab-parallel TP x DP.

    Local tensors: `hidden` `[n_local, padded_seq_len, H]` (this rank's sequences; TP peers hold the same),
    `weight` `[local vocab, H]` (this rank's rows of the lm_head, `contract.sharding.vocab_bounds`), `bias` its
    `[local vocab]`; `action_ids`, `completion_mask`, `old_logps` `[n_local, padded_seq_len]` (`old_logps=None`:
    on-policy, the old log-probs are the policy's own, so every ratio is exactly 1); `rewards` or `advantages=`
    as the contract declares. The reference: `ref_logps` `[n_local, padded_seq_len]` (computed elsewhere, e.g. by
    `linear_logprobs` of the reference model), or `ref_hidden` with `ref_weight` / `ref_bias` (default: the
    policy's weight and bias), or neither when `contract.beta == 0`. The result covers the whole batch on every
    rank; gradients flow into `hidden`, `weight` and `bias` (`weight` and `bias`: this rank's tokens' share, to be
    summed over DP by the trainer).

    `kernels`: "torch" (the portable reference), "triton" (tensor cores) or "auto" (Triton for CUDA tensors when
    it imports). Bad values raise `LossContractError` on every rank: with the torch kernels in the call; with the
    Triton kernels as the logits op's (`check_values`: "deferred", the default, flags them without a device sync and
    raises at a later call or at `grpo_core.raise_pending()`; "sync", in the call, after the forward's one sync).
    In one process without `top_entropy_quantile` the call's only other host read is its number of active tokens.
    """

    backend = "linear"

    def __init__(self, kernels: str = "auto") -> None:
        self.kernels = _check_kernels(kernels)

    def __call__(self, *args: Any, **kwargs: Any) -> GRPOLossResult:
        """The plain call, `linear_grpo_loss(*args, **kwargs)` with this op's kernel set (what
        `kernel_registry.get_op("linear_grpo_loss", backend=...)` returns)."""
        if "kernels" in kwargs:
            raise LossContractError(f"kernels: expected none (this op runs the {self.kernels!r} kernels: the backend "
                                    f"chosen in get_op), got {kwargs['kernels']!r}")
        return linear_grpo_loss(*args, kernels=self.kernels, **kwargs)

    def supports(self, contract: GRPOLossContract) -> list[str]:
        """Reasons this op cannot serve `contract` (empty when it can): it serves every contract, at every
        determinism scope (its bits are the same at every layout), where torch.distributed runs."""
        s = contract.sharding
        if (s.tp_world_size > 1 or s.dp_world_size > 1) and not dist.is_available():
            return ["torch.distributed is not available in this build of torch"]
        return []

    @staticmethod
    def _token_sum(terms: torch.Tensor) -> torch.Tensor:
        """Each sequence's token sum (a fixed tree over `padded_seq_len`)."""
        return canonical.pair_sum(terms)

    def _stages(self, k: TorchKernels | TritonKernels) -> _TorchKernels | _TritonKernels:
        """The kernels of the loss's stages after the log-probs, those of the logits op: with the Triton kernel set
        its Triton ones (the advantages, the token terms and their sums, the finish: a launch each), else the torch
        ones with `_token_sum`. The same bits."""
        return _TritonKernels() if k.name == "triton" else _TorchKernels(self._token_sum)

    def apply(self, hidden: torch.Tensor, weight: torch.Tensor, action_ids: torch.Tensor,
              old_logps: torch.Tensor | None = None, rewards: torch.Tensor | None = None, *,
              contract: GRPOLossContract, completion_mask: torch.Tensor, bias: torch.Tensor | None = None,
              ref_logps: torch.Tensor | None = None, ref_hidden: torch.Tensor | None = None,
              ref_weight: torch.Tensor | None = None, ref_bias: torch.Tensor | None = None,
              advantages: torch.Tensor | None = None, tp_group: Any = None, dp_group: Any = None,
              importance_sampling_ratio: torch.Tensor | None = None, sampling_logps: torch.Tensor | None = None,
              check_values: str = "deferred") -> GRPOLossResult:
        pending.poll((tp_group, dp_group))  # this op's collective checks: every rank raises at the same call
        tensors = {"hidden": hidden, "weight": weight, "bias": bias, "action_ids": action_ids,
                   "importance_sampling_ratio": importance_sampling_ratio, "sampling_logps": sampling_logps,
                   "old_logps": old_logps, "rewards": rewards, "advantages": advantages,
                   "completion_mask": completion_mask, "ref_logps": ref_logps, "ref_hidden": ref_hidden,
                   "ref_weight": ref_weight, "ref_bias": ref_bias}
        chosen: dict[str, Any] = {}
        checked: dict[str, torch.Tensor] = {}  # what the deferred check reads in place of the logits and old_logps

        def local_checks() -> torch.Tensor:  # inside the preflight: what one rank raises, every rank raises
            pending.poll()  # this process's local checks
            pending.check_mode(check_values)
            s = contract.sharding
            (seq_lo, seq_hi), (v_lo, v_hi) = s.sequence_bounds, s.vocab_bounds
            T = contract.padded_seq_len
            _check_linear(hidden, weight, bias, ref_logps, ref_hidden, ref_weight, ref_bias, old_logps,
                          seq_hi - seq_lo, T, v_hi - v_lo, contract.beta)
            chosen["kernels"] = _kernels(self.kernels, hidden.device, contract.vocab_tile)
            chosen["stages"] = self._stages(chosen["kernels"])
            check_option_inputs(sampling_logps, importance_sampling_ratio, contract.off_policy_mask_threshold,
                                contract.surrogate, contract.padded_seq_len)
            logits = stand_in((seq_hi - seq_lo, T, v_hi - v_lo), hidden.dtype, hidden.device)
            old = old_logps if old_logps is not None else torch.zeros(getattr(action_ids, "shape", ()),
                                                                      device=hidden.device)
            checked.update(logits=logits, old=old)
            return check_inputs(logits, logits if ref_hidden is not None else None, action_ids, old, rewards,
                                completion_mask, beta=contract.beta, vocab_size=contract.vocab_size,
                                num_rewards=seq_hi - seq_lo, rewards_required=True, advantages=advantages,
                                advantages_input=contract.advantages_input, ref_logps=ref_logps,
                                importance_sampling_ratio=importance_sampling_ratio, sampling_logps=sampling_logps,
                                values=chosen["stages"].name == "torch")  # Triton: the stages' flags, no sync

        def replicated() -> dict[str, str | None]:  # what TP peers must share, the hidden states at active tokens
            if contract.sharding.tp_world_size == 1:
                return {}
            return replicated_inputs(completion_mask, action_ids, old_logps, rewards, advantages, ref_logps,
                                     importance_sampling_ratio, sampling_logps,
                                     hidden=row_digests(hidden, completion_mask),
                                     ref_hidden=None if ref_hidden is None else row_digests(ref_hidden, completion_mask))

        def choices() -> dict[str, str]:  # what a rank chooses alone: the kernel set, the gradients it wants
            wanted = [name for name, t in (("hidden", hidden), ("weight", weight), ("bias", bias))
                      if torch.is_grad_enabled() and t is not None and t.requires_grad]
            chosen["gradients"] = wanted
            return {"kernels": chosen["kernels"].name, "gradients (requires_grad under grad mode)":
                    " / ".join(wanted) or "none", "check_values": check_values}

        mask = preflight(contract, BACKEND_ID, tensors, local_checks, replicated, tp_group, dp_group, choices)
        k, stages = chosen["kernels"], chosen["stages"]
        lp = contract.logprob_contract
        seq_lo, seq_hi = contract.sharding.sequence_bounds
        n_local, T, H = hidden.shape
        c = LossCall.of(contract, mask, action_ids, completion_mask, old_logps, importance_sampling_ratio,
                        sampling_logps, tp_group, dp_group, check_values)
        counts = c.gather(mask.sum(-1))  # before the pass: the token weights of a gradient computed in it
        advantages_all, adv, rewards_local, rewards_all = advantages_stage(c, rewards, advantages, stages)
        bonus = contract.entropy_coef != 0.0
        two_pass = (c.sequence or contract.off_policy_mask_threshold is not None or contract.vespo_gamma is not None
                    or bonus or contract.top_entropy_quantile < 1.0)  # from whole sequences, or from the whole batch

        def wanted(t: torch.Tensor | None, shape, dtype, new=torch.zeros) -> torch.Tensor | None:
            return new(shape, dtype=dtype, device=t.device) if t is not None and t.requires_grad else None

        if chosen["gradients"]:
            w_tok = canonical.token_weights(counts, contract.normalizer, contract.normalizer_value)[seq_lo:seq_hi]
            dh, dw, db = (wanted(hidden, (n_local * T, H), hidden.dtype), wanted(weight, weight.shape, torch.float32,
                          torch.empty), wanted(bias, (weight.shape[0],), torch.float32))

        # The call's host read, once all of the above is queued: its active tokens (a device sync)
        rows = mask.reshape(-1).nonzero().squeeze(1)
        ids = action_ids.reshape(-1)[rows].long()
        seq_of = rows // T

        # The log-probs (and the gradient, when every token's coefficient is known before the pass)
        given_ref = None if ref_logps is None else ref_logps.detach().reshape(-1)[rows].float()
        ref = None
        if ref_hidden is not None:  # without ref_weight the reference shares the policy's head, bias included
            ref_b = ref_bias if ref_bias is not None or ref_weight is not None else bias
            ref = (ref_hidden.detach().reshape(-1, H), (weight if ref_weight is None else ref_weight).detach(),
                   None if ref_b is None else ref_b.detach())
        grads = None
        if chosen["gradients"]:
            grads = (_CoefInputs(None if c.old is None else c.old.reshape(-1)[rows],
                                 adv[seq_of] if adv.dim() == 1 else adv.reshape(-1)[rows], w_tok[seq_of], given_ref,
                                 None if c.is_ratio is None else c.is_ratio.reshape(-1)[rows], *c.clip, contract.beta,
                                 contract.delta, contract.use_bias_correction_kl, contract.surrogate,
                                 contract.sapo_temperatures), dh, dw, db)
        matrices = (hidden.detach().reshape(-1, H), weight.detach(), None if bias is None else bias.detach())
        with torch.no_grad():  # two passes: the log-probs first, the gradients in a second pass
            logp_rows, ref_rows, ent_rows = _run_chunks(k, *matrices, ids, rows, lp, tp_group, c.inv,
                                                        None if two_pass else grads, ref, contract.entropy)
        if ref_rows is None:
            ref_rows = given_ref
        full = torch.zeros(n_local * T, dtype=torch.float32, device=hidden.device)
        logp = full.index_put((rows,), logp_rows).view(n_local, T)
        logp_ref = None if ref_rows is None else full.index_put((rows,), ref_rows).view(n_local, T)
        ent = None if ent_rows is None else full.index_put((rows,), ent_rows).view(n_local, T)
        if c.old is None:  # on-policy: the old log-probs are the policy's own
            c = dataclasses.replace(c, old=logp)

        # The token terms, the gathers, the finish, the checks (the torch stages': now; the Triton stages' flags
        # cover the inputs' values too and are read by `check_values`)
        sums, ints, phi, (ratio, w_is, keep) = stages.terms(c, logp, logp_ref, adv, ent, rewards_local)
        sums, ints = c.gather(sums.T).T.contiguous(), c.gather(ints.T).T.contiguous()
        scalars, _, flag = stages.finish(sums, ints, contract)
        loss = scalars[0]
        stages.settle(c, (checked["logits"], checked["logits"] if ref_hidden is not None else None, ref_logps,
                          checked["old"], rewards, advantages, importance_sampling_ratio, sampling_logps), flag,
                      ints[1], loss, logp, logp_ref,
                      None if rewards_all is None else (advantages_all, rewards_all, contract.groups),
                      _names(bias, ref_hidden), sums[1], "linear_grpo_loss (triton kernels)")

        # The gradient (its second pass when the coefficients needed the whole sequence or batch)
        if grads is not None and two_pass:
            if ratio is None:  # the Triton stages' kernel computed the token ratios it summed
                ratio = canonical.ratio_and_kl(logp, None, c.old, c.mask)[0]
            coef = loss_coef(c, ratio, logp, logp_ref, adv, w_tok, w_is)
            extra = {}
            if bonus:
                ent_w = canonical.entropy_bonus(sums[4], ints[3], contract.entropy_coef)[1]
                extra = dict(coef_h=torch.where(keep, ent_w, 0.0).reshape(-1)[rows], ent=ent_rows)
            with torch.no_grad():
                _run_chunks(k, *matrices, ids, rows, lp, tp_group, c.inv,
                            (dataclasses.replace(grads[0], coef=coef.reshape(-1)[rows], **extra), *grads[1:]))
        if grads is not None:  # each stored gradient with the dtype it is handed over in
            _, dh, dw, db = grads
            loss = _Grads.apply(loss, hidden, weight, bias, [
                (None if dh is None else dh.view(hidden.shape), hidden.dtype), (dw, weight.dtype),
                (db, None if bias is None else bias.dtype)], k.scale)
        return result_stage(c, loss, scalars, sums, ints, advantages_all, phi, ent,
                            provenance(self.backend, hidden, backend_id=BACKEND_ID, kernels=k.name))


def _names(bias: torch.Tensor | None, ref_hidden: torch.Tensor | None) -> tuple[str, str]:
    """The arguments the policy's and the reference's log-probs come from, for the messages."""
    policy = "hidden / weight" + (" / bias" if bias is not None else "")
    return policy, "ref_logps" if ref_hidden is None else "ref_hidden"


def _plain_call(hidden: Any, weight: Any, completion_mask: Any) -> tuple[int, int, Any]:
    """`(B, T, completion_mask)` of a plain call (the mask None: every token active), once `hidden` and `weight` are
    a 3-D and a 2-D tensor."""
    check_tensor("hidden", hidden)
    check_tensor("weight", weight)
    if hidden.dim() != 3 or weight.dim() != 2:
        raise LossContractError(f"hidden / weight: expected [B, T, H] and [V, H], got {list(hidden.shape)} and "
                                f"{list(weight.shape)}")
    B, T, _ = hidden.shape
    if B == 0 or T == 0:
        raise LossContractError(f"hidden: expected at least one sequence and one token (B >= 1, T >= 1), got shape "
                                f"{list(hidden.shape)}")
    if completion_mask is None:
        completion_mask = torch.ones((B, T), dtype=torch.bool, device=hidden.device)
    return B, T, completion_mask


def linear_grpo_loss(hidden: torch.Tensor, weight: torch.Tensor, action_ids: torch.Tensor,
                     old_logps: torch.Tensor | None = None, rewards: torch.Tensor | None = None,
                     completion_mask: torch.Tensor | None = None, *, bias: torch.Tensor | None = None,
                     advantages: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
                     ref_hidden: torch.Tensor | None = None, ref_weight: torch.Tensor | None = None,
                     ref_bias: torch.Tensor | None = None, clip_eps: float = 0.2, clip_eps_high: float | None = None,
                     beta: float = 0.04, temperature: float = 1.0, samples_per_prompt: int | None = None,
                     group_boundaries: Any = None, normalizer: Any = None, normalizer_constant: float | None = None,
                     loss_type: str | None = None, max_completion_length: int | None = None,
                     advantage_std: Any = None, vocab_tile: int = DEFAULT_VOCAB_TILE,
                     kernels: str = "auto", delta: float | None = None, use_bias_correction_kl: bool = False,
                     importance_sampling_ratio: torch.Tensor | None = None, sapo_temperature_pos: float | None = None,
                     sapo_temperature_neg: float | None = None, importance_sampling_level: str = "token",
                     off_policy_mask_threshold: float | None = None, sampling_logps: torch.Tensor | None = None,
                     vespo_k_pos: float | None = None, vespo_lambda_pos: float | None = None,
                     vespo_k_neg: float | None = None, vespo_lambda_neg: float | None = None, entropy: bool = False,
                     entropy_coef: float = 0.0, top_entropy_quantile: float = 1.0,
                     check_values: str = "deferred") -> GRPOLossResult:
    """The fused linear loss in one process: `LinearGRPOLossOp(kernels).apply` with the contract these arguments
    make (the same options as the logits op: `grpo_loss`'s docstring and the README; `check_values` as `apply`'s).
    `hidden` `[B, T, H]`, `weight` `[V, H]`; `completion_mask` None: every token is active. Unpacks as `loss,
    policy_loss, kl`."""
    check_tensor("action_ids", action_ids)
    B, T, completion_mask = _plain_call(hidden, weight, completion_mask)
    kind = AdvantagesInput.REWARDS
    if advantages is not None and isinstance(advantages, torch.Tensor):
        kind = AdvantagesInput.TOKEN if advantages.dim() == 2 else AdvantagesInput.SEQUENCE
    contract = GRPOLossContract(
        num_sequences=B, padded_seq_len=T, vocab_size=weight.shape[0], clip_eps=clip_eps, clip_eps_high=clip_eps_high,
        beta=beta, samples_per_prompt=samples_per_prompt, group_boundaries=group_boundaries, normalizer=normalizer,
        normalizer_constant=normalizer_constant, advantage_std=advantage_std, temperature=temperature,
        advantages_input=kind, loss_type=loss_type, max_completion_length=max_completion_length,
        vocab_tile=vocab_tile, determinism_scope="topology_invariant", delta=delta,
        use_bias_correction_kl=use_bias_correction_kl, sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg, importance_sampling_level=importance_sampling_level,
        off_policy_mask_threshold=off_policy_mask_threshold, vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg, entropy=entropy, entropy_coef=entropy_coef,
        top_entropy_quantile=top_entropy_quantile)
    return LinearGRPOLossOp(kernels).apply(hidden, weight, action_ids, old_logps, rewards, contract=contract,
                                           completion_mask=completion_mask, bias=bias, ref_logps=ref_logps,
                                           ref_hidden=ref_hidden, ref_weight=ref_weight, ref_bias=ref_bias,
                                           advantages=advantages, importance_sampling_ratio=importance_sampling_ratio,
                                           sampling_logps=sampling_logps, check_values=check_values)


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, action_ids: torch.Tensor,
                    completion_mask: torch.Tensor | None = None, *, bias: torch.Tensor | None = None,
                    temperature: float = 1.0, vocab_tile: int = DEFAULT_VOCAB_TILE,
                    contract: LogprobContract | None = None, tp_group: Any = None, kernels: str = "auto",
                    check_values: str = "deferred") -> torch.Tensor:
    """Per-token log-probs fp32 `[B, T]` (0.0 at masked tokens) from `hidden` `[B, T, H]` and `weight` `[V, H]`
    (with `contract`, a `LogprobContract` over `B * T` tokens: this TP rank's `[local vocab, H]` rows): the very
    bits the loss computes for these tokens with the same kernels, so an old-policy or reference pass made with it
    feeds the loss without drift. No gradient. The values (ids in the vocabulary and mask values 0 / 1 at active
    tokens, finite log-probs there) are one flag computed after the pass: `check_values` "deferred" hands it to
    `pending` (on CUDA no device sync: the error at a later call of an op that defers its checks, or at
    `grpo_core.raise_pending()`), "sync" reads it in the call. Either way the call reads one value on the host before
    the pass, its number of active tokens."""
    pending.check_mode(check_values)
    B, T, completion_mask = _plain_call(hidden, weight, completion_mask)
    H = hidden.shape[2]
    if contract is None:
        contract = LogprobContract(vocab_size=weight.shape[0], tile_width=vocab_tile, num_tokens=B * T)
    elif not isinstance(contract, LogprobContract) or contract.num_tokens != B * T:
        raise LossContractError(f"contract: expected a LogprobContract with num_tokens = B * T = {B * T}, got "
                                f"{contract!r}")
    # Over TP every peer holds the same flag and reads its peers' queue alone: every peer raises at the same call
    key = ("linear_logprobs", tp_group) if len(contract.vocab_shard_bounds) > 1 else None
    pending.poll(key)
    lo, hi = contract.local_bounds
    _check_linear(hidden, weight, bias, None, None, None, None, None, B, T, hi - lo, 0.0)
    logits = stand_in((B, T, hi - lo), hidden.dtype, hidden.device)
    no_old = torch.zeros((), device=hidden.device).expand(B, T)  # what `check_inputs` takes for old_logps

    def checked_mask(values: bool) -> torch.Tensor:
        return check_inputs(logits, None, action_ids, no_old, None, completion_mask, beta=0.0,
                            vocab_size=contract.vocab_size, values=values)

    mask = checked_mask(False)  # types, shapes, dtypes and devices; the values below, with the log-probs
    inv = inverse_temperature(check_temperature(temperature))
    rows = mask.reshape(-1).nonzero().squeeze(1)  # the host read
    ids = action_ids.reshape(-1)[rows].long()
    with torch.no_grad():  # an id outside the vocabulary selects no column, as another TP rank's id does
        k = _kernels(kernels, hidden.device, contract.tile_width)
        logp, *_ = _run_chunks(k, hidden.detach().reshape(-1, H), weight.detach(),
                               None if bias is None else bias.detach(), ids, rows, contract, tp_group, inv)
    out = torch.zeros(B * T, dtype=torch.float32, device=hidden.device).index_put((rows,), logp).view(B, T)
    bad = ((ids < 0) | (ids >= contract.vocab_size)).any() | ~torch.isfinite(logp).all()
    if completion_mask.dtype != torch.bool:
        bad |= ((completion_mask != 0) & (completion_mask != 1)).any()

    def recheck() -> None:  # the checks that say what and where
        checked_mask(True)
        check_logprobs(out, None, mask, _names(bias, None))

    if check_values == "sync":
        pending.raise_now(bad, recheck)
    else:
        pending.defer(bad, recheck, "linear_logprobs", group=key)
    return out
