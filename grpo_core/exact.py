"""Exact on-policy: the sampler's log-probs are the trainer's, bit for bit.

    with exact_on_policy(model, seed=0) as mode:                 # model: a llama, qwen2 or qwen3 causal LM
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64, do_sample=True, temperature=0.9)
        sampler = mode.logps                                      # [B, new tokens] fp32
    # the trainer's log-probs of those tokens: the backbone under the mode, then `linear_logprobs`; the same bits

`generate` (a KV cache, one token a step, B rows) and the training forward (the whole sequence, micro-batches of
rows) give a token's log-prob by other arithmetic: other matmul kernels for other row counts, reductions split by the
number of rows, attention over other key extents. Under the mode every operation of the model gives each token's row
the same bits whatever the rows beside it, the number of keys before and after it, and the cache:
- every `nn.Linear`: one fixed order of adds per output element (`linear.py`'s kernel sets: on CUDA the
  fixed-configuration Triton matmul, on the CPU fp32 products (exact for bf16 and fp16 inputs) in a `pair_sum`
  tree), rounded once to the layer's dtype;
- RMSNorm: the mean of squares by `pair_sum`, the reciprocal square root by `canonical.sqrt` and IEEE division;
- SiLU: `canonical.sigmoid` (IEEE `+ - * /` only: no vector-width or tail-loop code path can change a bit);
- rotary embeddings: one table of cos / sin over every position of the model, computed once and indexed;
- attention (registered through transformers' attention interface): each (query, key) score a `pair_sum` of fp32
  products, the softmax with the row's exact max, `canonical.exp` and `pair_sum`s over the keys indexed by their
  position in the sequence (left padding skipped), so that masked keys (padding, the future, a longer cache) add exact
  zeros to a tree whose shape does not depend on them;
- the LM head and the sampling distribution: `linear_logprobs`' kernels at the sampling temperature. A token is drawn
  by Gumbel-max from the fp32 logits times 1 / temperature, the noise a counter-based hash of (seed, the row's key, the
  token's index, the vocabulary id): a row's completion depends on its prompt, its key and the weights only, not on
  the batch beside it. The recorded log-prob is `linear_logprobs` of the sampled token, the very call the trainer makes.
The whole temperature-scaled distribution is sampled, the one the trainer scores: generation settings that would
change it (top-k, top-p, min-p, typical-p, repetition penalties, suppressed or forced tokens, a minimum length,
beams) are refused, never approximated. A forward without `position_ids` takes them from the attention mask as
`generate` does (TRL's training forward passes none: left-padded prompts would otherwise sit at other positions).

Backward: each replaced operation's gradient is that of the model's own formula (`F.linear`, HF's RMSNorm, `F.silu`,
softmax attention) at the same inputs: the forward bits are the mode's, the gradients are ordinary autograd's.

What it covers: `LlamaForCausalLM`, `Qwen2ForCausalLM` and `Qwen3ForCausalLM` (their forward uses only the operations
above, residual adds, casts, the embedding's gather and the cache's concatenation), SiLU MLPs, a static RoPE, full
causal attention without dropout. Anything else (another model type, a module of another class inside, sliding
windows, another activation, a RoPE that changes with the length, PEFT adapters) is refused by name.

Cost: attention, RMSNorm, SiLU and the sampler's noise are elementwise torch operations on every device (the CPU's
linear layers too, a product per multiply-add): correct and slow. On one H100 at Qwen2.5-0.5B's shape a training
step took 18.5 s against 0.41 s without the mode (benchmarks/README.md); fused kernels for them are the way to the
cost of the plain model.
"""

from __future__ import annotations

import contextlib
import copy
import types
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from . import canonical
from .contract import DEFAULT_VOCAB_TILE, check_temperature, inverse_temperature
from .linear import _kernels as _kernel_set, linear_logprobs
from .recorder import key_of

__all__ = ["ExactOnPolicy", "SUPPORTED_MODEL_TYPES", "check_generation", "exact_on_policy"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
ATTENTION = "grpo_core_exact"
_ATTENTION_CHUNK = 1 << 25  # products per step of the attention's CPU form (a slice of queries at a time)
_M32 = 0xFFFFFFFF
# generation settings that change the sampled distribution, and the values that leave it alone
_NEUTRAL = {"top_k": (None, 0), "top_p": (None, 1.0), "min_p": (None, 0.0), "typical_p": (None, 1.0),
            "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0), "repetition_penalty": (None, 1.0),
            "encoder_repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0),
            "bad_words_ids": (None,), "suppress_tokens": (None,), "begin_suppress_tokens": (None,),
            "sequence_bias": (None,), "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
            "min_length": (None, 0), "min_new_tokens": (None, 0), "exponential_decay_length_penalty": (None,),
            "guidance_scale": (None, 1.0), "num_beams": (None, 1), "watermarking_config": (None,),
            "diversity_penalty": (None, 0.0), "num_beam_groups": (None, 1), "penalty_alpha": (None,),
            "prompt_lookup_num_tokens": (None,), "assistant_model": (None,), "assistant_early_exit": (None,),
            "top_h": (None,), "custom_generate": (None,), "num_return_sequences": (None, 1),
            "output_scores": (None, False), "output_logits": (None, False)}


class _Exact(torch.autograd.Function):
    """`fn(*args)`'s bits forward; backward, the gradient of `ref(*args)` (the model's own formula)."""

    @staticmethod
    def forward(ctx, fn, ref, *args):
        ctx.ref = ref
        ctx.save_for_backward(*args)
        return fn(*args)

    @staticmethod
    def backward(ctx, grad):
        need = ctx.needs_input_grad[2:]
        args = [a.detach().requires_grad_(True) if n else a for a, n in zip(ctx.saved_tensors, need)]
        with torch.enable_grad():
            out = ctx.ref(*args)
        got = iter(torch.autograd.grad(out, [a for a, n in zip(args, need) if n], grad))
        return (None, None, *[next(got) if n else None for n in need])


def _exact(fn, ref, *args):
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return _Exact.apply(fn, ref, *args)
    return fn(*args)


def _kernels(device: torch.device):
    """The kernel set `linear_logprobs` takes by default on `device` (its logits are the trainer's)."""
    return _kernel_set("auto", device, DEFAULT_VOCAB_TILE)


def _linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    def fn(x, w, b):
        h = x.reshape(-1, x.shape[-1])
        dtype = torch.promote_types(x.dtype, w.dtype)
        if h.shape[0] == 0:
            return torch.empty((*x.shape[:-1], w.shape[0]), dtype=dtype, device=x.device)
        return _kernels(x.device).logits(h, w, b).to(dtype).view(*x.shape[:-1], w.shape[0])
    return _exact(fn, F.linear, x, module.weight, module.bias)


def _rms_norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    eps = module.variance_epsilon

    def fn(x, w):
        h = x.float()
        mean = canonical.pair_sum(h * h) / canonical.fp32(h.shape[-1], h)  # tensor divisors: IEEE division
        r = torch.ones_like(mean) / canonical.sqrt(mean + canonical.fp32(eps, h))
        return w * (h * r.unsqueeze(-1)).to(x.dtype)

    def ref(x, w):  # transformers' RMSNorm
        h = x.float()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return _exact(fn, ref, x, module.weight)


def _silu(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _exact(lambda x: (x.float() * canonical.sigmoid(x.float())).to(x.dtype), F.silu, x)


def _rotary(module: torch.nn.Module, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """cos and sin at `position_ids` from one table over the model's positions, made once per device by the module's
    own forward: a position's values are the same bits in every call."""
    table = module._grpo_core_table.get(x.device)
    if table is None:
        n = module.config.max_position_embeddings
        positions = torch.arange(n, device=x.device)[None]
        cos, sin = type(module).forward(module, torch.empty(0, device=x.device), positions)
        table = module._grpo_core_table[x.device] = (cos[0].float(), sin[0].float())
    if position_ids.numel() and (int(position_ids.max()) >= table[0].shape[0] or int(position_ids.min()) < 0):
        raise ValueError(f"position_ids: expected positions in [0, {table[0].shape[0]}) (the model's "
                         f"max_position_embeddings), got {int(position_ids.min())} to {int(position_ids.max())}")
    return table[0][position_ids].to(x.dtype), table[1][position_ids].to(x.dtype)


def _aligned(mask: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`mask` `[B, 1, Tq, Tk]` and the key tensors `[B, H, Tk, D]` with each row's keys moved to start at its first
    key that any query sees (its left padding skipped), masked past the end: a key's index is then its position in
    the sequence, whatever the padding before it and the length of the cache."""
    B, _, Tq, Tk = mask.shape
    shift = (~mask.any(2)[:, 0]).int().cumprod(-1).sum(-1)  # [B] leading keys no query sees
    at = torch.arange(Tk, device=mask.device)[None] + shift[:, None]
    inside = at < Tk
    at = at.clamp(max=Tk - 1)
    mask = mask.gather(3, at[:, None, None, :].expand(B, 1, Tq, Tk)) & inside[:, None, None, :]
    return (mask, *(t.gather(2, at[:, None, :, None].expand(t.shape)) for t in tensors))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """`[B, Tq, Hq, D]` in q's dtype: softmax(q k^T * scaling, masked) v, every sum a `pair_sum` over the key's
    position, the exponentials `canonical.exp`: the same bits for a query whatever the rows, keys and cache beside."""
    mask, k, v = _aligned(mask, k, v)
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    qf = q.float().reshape(B, Hkv, g, Tq, D)
    kf, vf = k.float()[:, :, None], v.float()[:, :, None]  # [B, Hkv, 1, Tk, D]
    scale = canonical.fp32(scaling, qf)
    out = torch.empty((B, Hkv, g, Tq, D), dtype=torch.float32, device=q.device)
    step = max(1, _ATTENTION_CHUNK // max(1, B * Hq * Tk * D))
    for i in range(0, Tq, step):
        qi, mi = qf[:, :, :, i:i + step], mask[:, :, None, i:i + step]  # mask [B, 1, 1, t, Tk]
        s = canonical.pair_sum(qi[..., :, None, :] * kf[..., None, :, :]) * scale  # [B, Hkv, g, t, Tk]
        s = s.masked_fill(~mi, float("-inf"))
        m = s.amax(-1, keepdim=True)
        p = canonical.exp(s - torch.where(torch.isfinite(m), m, 0.0))
        total = canonical.pair_sum(p)
        o = canonical.pair_sum(p[..., None] * vf[..., None, :, :], dim=-2)  # [B, Hkv, g, t, D]
        out[:, :, :, i:i + step] = torch.where(total[..., None] > 0, o / total[..., None], 0.0)
    return out.view(B, Hq, Tq, D).to(q.dtype).transpose(1, 2).contiguous()


def _attend_ref(q, k, v, mask, scaling):  # softmax attention by autograd's own ops (the gradient)
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q.float() @ k.float().transpose(-1, -2) * scaling).masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ v.float()).to(q.dtype).transpose(1, 2).contiguous()


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface (`config._attn_implementation = "grpo_core_exact"`)."""
    if dropout:
        raise ValueError(f"dropout: the exact mode's attention has no dropout, got {dropout}")
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}: the exact mode's attention is full causal softmax attention, got "
                             f"{name}={kwargs[name]!r}")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    Tq, Tk = query.shape[2], key.shape[2]
    if attention_mask is None:  # causal: the queries are the last Tq of the Tk positions
        rows = torch.arange(Tq, device=query.device)[:, None] + (Tk - Tq)
        attention_mask = (torch.arange(Tk, device=query.device)[None] <= rows).expand(query.shape[0], 1, Tq, Tk)
    if attention_mask.dtype != torch.bool:
        raise ValueError(f"attention_mask: expected the boolean mask of the exact mode's mask function, got "
                         f"{attention_mask.dtype}")
    return _exact(lambda q, k, v, m: _attend(q, k, v, m, scaling), lambda q, k, v, m: _attend_ref(q, k, v, m, scaling),
                  query, key, value, attention_mask), None


def _mask(*args, **kwargs):
    """sdpa's boolean mask, always materialized (never None for a causal skip)."""
    from transformers.masking_utils import sdpa_mask
    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, _mask)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash of int64 values in [0, 2**32) (a bijection; every product below 2**59)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def _leading_zeros(x: torch.Tensor) -> torch.Tensor:
    """The leading zero bits of int64 values in [0, 2**32) as 32-bit words (32 for 0)."""
    n = torch.zeros_like(x)
    for shift in (16, 8, 4, 2, 1):
        low = x < (1 << (32 - shift))
        n, x = n + low * shift, torch.where(low, x << shift, x)
    return n + (x == 0)


def gumbel(seed: int, keys: torch.Tensor, index: int, vocab: int) -> torch.Tensor:
    """fp32 `[B, vocab]` standard Gumbel noise `-log(E)`, `E` exponential, a function of (seed, each row's int64 key,
    the token's index, the vocabulary id) alone: integer hashing, IEEE arithmetic and the canonical log (the same bits
    on every device). `E = -log(1 - w)` from a uniform `w` with a floating exponent (down to 2**-64: a 24-bit
    significand and 64 hash bits of exponent), so the noise reaches 44 and a token 40 below the best logit is still
    drawn at its rate; below 2**-10, `E` is `log1p`'s series."""
    s = _mix(_mix(torch.tensor(seed & _M32, device=keys.device)) ^ ((seed >> 32) & _M32))
    row = _mix(_mix(_mix(_mix(s ^ ((keys >> 32) & _M32)) ^ (keys & _M32)) ^ index))
    h = [_mix(row[:, None] ^ _mix(torch.arange(vocab, device=keys.device)[None] * 3 + lane)) for lane in range(3)]
    return -canonical.log(_exponential(*h))


def _exponential(h0: torch.Tensor, h1: torch.Tensor, h2: torch.Tensor) -> torch.Tensor:
    """`-log(1 - w)` for the uniform `w` of three 32-bit hashes: `h1`'s (then `h2`'s) leading zeros the exponent,
    `h0` the significand."""
    k = _leading_zeros(h1)
    k = k + torch.where(k == 32, _leading_zeros(h2), 0)  # w in [2**-(k+1), 2**-k)
    w = (1.0 + (h0 >> 9).float() * 2.0 ** -23) * canonical._pow2(-(k + 1).to(torch.int32))
    one = torch.ones_like(w)
    return torch.where(w < 2.0 ** -10, w + w * w / (one + one) + w * w * w / (one + one + one),
                       -canonical.log(one - w))


def prompt_keys(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Each row's default key: a hash of its prompt's tokens (padding left out) and its occurrence among the rows
    with that prompt: a prompt's completions do not depend on the other prompts of the batch."""
    rows = input_ids.tolist() if attention_mask is None else [
        [t for t, m in zip(r, mr) if m] for r, mr in zip(input_ids.tolist(), attention_mask.tolist())]
    seen: dict[tuple, int] = {}
    out = []
    for r in rows:  # the recorder's sequence key (43 of its 64 bits: an int64 >= 0), then the occurrence
        n = seen[tuple(r)] = seen.get(tuple(r), -1) + 1
        out.append((int(key_of(r, ()), 16) >> 21) << 20 | n)
    return torch.tensor(out, dtype=torch.int64, device=input_ids.device)


class _Sampler:
    """The logits processor the mode hands `generate`: it ignores `scores` (transformers' head), takes the final norm's
    last row, draws the token from the trainer's distribution and returns a score vector `generate`'s greedy choice
    can only take that token from."""

    def __init__(self, mode: ExactOnPolicy, keys: torch.Tensor, start: int, temperature: float, sample: bool):
        self.mode, self.keys, self.start, self.temperature, self.sample = mode, keys, start, temperature, sample
        self.logps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        h = self.mode.hidden[:, -1:]
        weight, bias = self.mode.head()
        if self.mode.fp32_head:
            h = h.float()
        inv = canonical.fp32(inverse_temperature(self.temperature), scores)
        z = _kernels(h.device).logits(h[:, 0], weight, bias) * inv  # the trainer's distribution, fp32
        index = input_ids.shape[1] - self.start
        if self.sample:
            z = z + gumbel(self.mode.seed, self.keys, index, z.shape[1])
        token = z.argmax(-1)
        self.logps.append(linear_logprobs(h, weight, token[:, None], bias=bias, temperature=self.temperature,
                                          check_values="sync")[:, 0])
        return torch.full_like(scores, float("-inf")).scatter_(1, token[:, None].to(scores.device), 0.0)


class ExactOnPolicy:
    """The mode on one model (see the module docstring). `install()` / `remove()`, or a context manager.

    `seed`: the sampler's; `fp32_head`: the LM head in fp32 (TRL's `cast_lm_head_to_fp32`); `keys`: set before a
    `generate` call, the rows' int64 keys for that call only (default: `prompt_keys`). After `generate`: `logps`, the
    sampled tokens' log-probs `[B, new tokens]` fp32 (past a finished row's end: of the tokens drawn there and replaced
    by padding). One mode per model at a time."""

    def __init__(self, model: torch.nn.Module, seed: int = 0, fp32_head: bool = False):
        self.model, self.seed, self.fp32_head = model, int(seed), bool(fp32_head)
        self.keys: torch.Tensor | None = None
        self.logps: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None
        self.plan = check_model(model)
        self._undo: list = []

    def head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        head = self.model.get_output_embeddings()
        w, b = head.weight, head.bias
        return (w.float(), None if b is None else b.float()) if self.fp32_head else (w, b)

    def install(self) -> ExactOnPolicy:
        if self._undo:
            return self
        if getattr(self.model, "_grpo_core_exact", None) is not None:
            raise ValueError("model: expected a model without an exact mode, got one that already has one (one mode "
                             "per model at a time)")
        _register()
        self.model._grpo_core_exact = self
        self._undo.append(lambda: self.model.__dict__.pop("_grpo_core_exact", None))
        for module, fn in self.plan:
            before = module.__dict__.get("forward")  # an instance's own forward (TRL's fp32 LM head) comes back
            module.forward = types.MethodType(fn, module)
            if fn is _rotary:
                module._grpo_core_table = {}
            self._undo.append(lambda m=module, f=before: (
                m.__dict__.pop("forward", None) if f is None else setattr(m, "forward", f),
                m.__dict__.pop("_grpo_core_table", None)))
        config, model = self.model.config, self.model
        before = config._attn_implementation
        model.set_attn_implementation(ATTENTION)
        self._undo.append(lambda: model.set_attn_implementation(before))
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
        handles = [base.register_forward_pre_hook(_positions, with_kwargs=True),
                   base.norm.register_forward_hook(self._keep)]
        self._undo.extend(h.remove for h in handles)
        model.generate = types.MethodType(_generate(self, type(model).generate), model)
        self._undo.append(lambda: model.__dict__.pop("generate", None))
        return self

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _keep(self, module, args, output):
        self.hidden = output

    def __enter__(self) -> ExactOnPolicy:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()


@contextlib.contextmanager
def exact_on_policy(model: torch.nn.Module, seed: int = 0, fp32_head: bool = False) -> Iterator[ExactOnPolicy]:
    """`ExactOnPolicy(model, seed, fp32_head)` installed for the block."""
    with ExactOnPolicy(model, seed, fp32_head) as mode:
        yield mode


def _positions(module, args, kwargs):
    """A forward without `position_ids` takes them from the 2-D attention mask as `generate` does (cumulative count
    of the attended tokens minus one, 0 on padding), the last `T` of them."""
    mask = kwargs.get("attention_mask")
    ids = kwargs.get("input_ids", args[0] if args else None)
    ref = ids if ids is not None else kwargs.get("inputs_embeds")
    if kwargs.get("position_ids") is not None or mask is None or mask.dim() != 2 or ref is None:
        return None
    T = ref.shape[1]
    positions = mask.long().cumsum(-1) - 1
    kwargs["position_ids"] = positions.masked_fill(mask == 0, 0)[:, -T:]
    return args, kwargs


def check_generation(config: Any) -> None:
    """Refuses a generation config whose settings change the sampled distribution, naming the first."""
    for name, neutral in _NEUTRAL.items():
        value = getattr(config, name, None)
        if value not in neutral:
            raise ValueError(f"{name}: the exact mode samples the whole temperature-scaled distribution (the one the "
                             f"trainer scores); expected {' or '.join(map(repr, neutral))}, got {value!r}")


def _generate(mode: ExactOnPolicy, generate):
    from transformers import LogitsProcessorList

    def wrapped(self, *args, **kwargs):
        keys, mode.keys = mode.keys, None  # for this call only, refused or not
        if len(args) > 1:
            raise ValueError("generate: under the exact mode pass the prompts' ids alone by position, the rest by name")
        config = copy.deepcopy(kwargs.pop("generation_config", None) or self.generation_config)
        fields = {k: kwargs.pop(k) for k in list(kwargs) if hasattr(config, k) and not isinstance(
            kwargs[k], torch.Tensor)}
        for name, value in fields.items():
            setattr(config, name, value)
        check_generation(config)
        if kwargs.get("logits_processor") or kwargs.get("prefix_allowed_tokens_fn") is not None:
            raise ValueError("logits_processor: the exact mode samples the whole temperature-scaled distribution; "
                             "expected none, got a processor")
        ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError(f"input_ids: the exact mode's generate needs the prompts' ids [B, T], got "
                             f"{type(ids).__name__}")
        sample = bool(config.do_sample)
        temperature = check_temperature(config.temperature if sample and config.temperature is not None else 1.0)
        mask = kwargs.get("attention_mask")
        pad = config.pad_token_id
        if mask is None and pad is not None and (ids == pad).any() and pad not in _as_list(config.eos_token_id):
            mask = kwargs["attention_mask"] = (ids != pad).long()  # as generate infers it
        keys = keys if keys is not None else prompt_keys(ids, mask)
        if not isinstance(keys, torch.Tensor) or keys.shape != (ids.shape[0],) or keys.dtype != torch.int64:
            raise ValueError(f"keys: expected an int64 tensor [{ids.shape[0]}] (one per row), got "
                             f"{getattr(keys, 'dtype', type(keys).__name__)} {list(getattr(keys, 'shape', []))}")
        prompt = int(ids.shape[1] if mask is None else mask.sum(-1).max())
        new = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - ids.shape[1]
        if prompt + new - 1 > self.config.max_position_embeddings:  # the last new token is never fed back
            raise ValueError(f"max_new_tokens: a prompt of {prompt} tokens and {new} new ones need "
                             f"{prompt + new - 1} positions, more than the model's max_position_embeddings "
                             f"{self.config.max_position_embeddings}")
        sampler = LogitsProcessorList([_Sampler(mode, keys.to(ids.device), ids.shape[1], temperature, sample)])
        config.do_sample, config.temperature, config.top_k, config.top_p = False, 1.0, None, 1.0
        try:
            out = generate(self, *args, generation_config=config, logits_processor=sampler, **kwargs)
        finally:
            mode.hidden = None
        picked = sampler[0].logps
        mode.logps = (torch.stack(picked, 1) if picked
                      else torch.zeros((ids.shape[0], 0), dtype=torch.float32, device=ids.device))
        return out
    return wrapped


def _as_list(x: Any) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def check_model(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Any]]:
    """The modules the mode replaces and their forms; raises naming what it does not cover."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise ValueError(f"model: expected a transformers causal LM, got {type(model).__name__}")
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES or not type(model).__name__.endswith("ForCausalLM"):
        raise ValueError(f"model: the exact mode covers {', '.join(SUPPORTED_MODEL_TYPES)} causal LMs (their forward "
                         f"uses only the operations it replaces), got {type(model).__name__} (model_type {kind!r})")
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act: the exact mode covers SiLU MLPs, got {config.hidden_act!r}")
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()) or getattr(
            config, "use_sliding_window", False):
        raise ValueError("layer_types: the exact mode covers full attention, got sliding-window layers")
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError(f"attention_dropout: expected 0.0 under the exact mode, got {config.attention_dropout}")
    if getattr(config, "pretraining_tp", 1) != 1:
        raise ValueError(f"pretraining_tp: expected 1 under the exact mode, got {config.pretraining_tp}")
    plan = []
    for name, m in model.named_modules():
        cls = type(m).__name__
        if hasattr(m, "_hf_hook"):
            raise ValueError(f"{name or 'model'}: the exact mode needs the model's modules without accelerate hooks "
                             f"(device_map offloading), got a {type(m._hf_hook).__name__}")
        if isinstance(m, torch.nn.Linear) and type(m) is torch.nn.Linear:
            plan.append((m, _linear))
        elif type(m) is torch.nn.Embedding or isinstance(m, (torch.nn.ModuleList,)) or m is model:
            continue
        elif cls.endswith("RMSNorm") and hasattr(m, "variance_epsilon") and len(list(m.children())) == 0:
            plan.append((m, _rms_norm))
        elif cls.endswith("RotaryEmbedding"):
            rope = getattr(m, "rope_type", "default")
            if rope not in ("default", "linear", "llama3"):
                raise ValueError(f"{name}: the exact mode covers a RoPE fixed per position (default, linear, "
                                 f"llama3), got rope_type {rope!r}")
            plan.append((m, _rotary))
        elif cls in ("SiLUActivation", "SiLU"):
            plan.append((m, _silu))
        elif any(cls.endswith(s) for s in ("Model", "DecoderLayer", "Attention", "MLP")) and cls.lower().startswith(
                kind.replace("_", "")):
            continue
        else:
            raise ValueError(f"{name}: the exact mode does not cover a {cls} module (a {kind} model holds Linear, "
                             f"Embedding, RMSNorm, rotary embedding and SiLU leaves only)")
    return plan
