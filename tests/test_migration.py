"""The README's migration lines against the formulas of RL-Kernel, Liger, TRL and verl, re-implemented here in a
few lines of plain torch from those projects' sources (which CI cannot install), on a grid of uniform and CSR
groups, beta 0 and 0.04, temperatures 1 and 0.7, fp32 and bf16 logits, masks with holes and empty sequences.

Each `# migrate: <name>` block of the README's migration section is executed as printed, with the peer's variable
names bound to the grid's tensors, and must give the peer's loss and gradient within fp32 tolerance, through the
automatic choice and (one fp32 case in five, under the interpreter) the Triton backend. Run this file
(`python tests/test_migration.py`) for the largest difference per peer formula on the whole grid.

Sources read (file, revision):
- RL-Kernel `rl_engine/reference/loss/grpo_loss.py`, `ratio_kl.py` (RL-Align/RL-Kernel 19b7dc37, b45560a8);
- Liger `src/liger_kernel/ops/grpo_loss.py` (`_grpo_loss_fwd_kernel`, `_reduce_loss`, `_compute_dapo_normalizer`)
  and `transformers/grpo_loss.py::triton_grpo_loss`;
- TRL `trainer/grpo_trainer.py` (`_compute_loss`, the advantages of `_generate_and_score_completions`) and
  `GRPOConfig`'s `loss_type` documentation;
- verl `verl/trainer/ppo/core_algos.py` (`compute_policy_loss_vanilla`, `agg_loss`, `kl_penalty`,
  `compute_grpo_outcome_advantage`; volcengine/verl 012be9d9).
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import torch

from grpo_core import GRPOLossContract, kernel_registry

README = Path(__file__).resolve().parents[1] / "README.md"
B, T, V = 8, 12, 263
UNIFORM, CSR = 4, (0, 3, 5, 8)
EMPTY = (2, 5)


def snippets() -> dict[str, str]:
    """The README's `# migrate: <name>` blocks (fenced as `py`, so that test_readme's script does not run them)."""
    text = README.read_text()
    return {name: code for code, name in re.findall(r"```py\n(# migrate: ([\w-]+)[^\n]*\n.*?)```", text, re.S)}


def run_snippet(name: str, env: dict, backend: str | None = None) -> torch.Tensor:
    scope = {"grpo_loss": kernel_registry.get_op("grpo_loss", backend=backend), "torch": torch, **env}
    exec(compile(snippets()[name], f"README.md ({name})", "exec"), scope)
    return scope["loss"]


# ---------------------------------------------------------------------------------------------------------------
# The peers' formulas, in their own precision (fp32 after their casts), from their sources.

def _select(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def rl_kernel(policy_logits, ref_logits, action_ids, old_logps, rewards, completion_mask, *, clip_eps=0.2, beta=0.0,
              samples_per_prompt=None, group_boundaries=None, eps=1e-6, sample_advantages=None):
    """NativeGRPOLossOp.forward / .apply: population std from E[r^2] - mean^2 clamped at eps^2; token-mean over the
    batch (denominator clamped at 1e-8); symmetric clip; loss = policy + beta * kl."""
    mask = completion_mask.bool()
    ids = action_ids.masked_fill(~mask, 0)
    logp = _select(policy_logits.float(), ids)
    with torch.no_grad():
        logp_ref = _select(ref_logits.float(), ids)
    delta = (logp - old_logps.float()).masked_fill(~mask, 0.0)
    diff = (logp_ref - logp).masked_fill(~mask, 0.0)
    ratio, kl_terms = torch.exp(delta), torch.exp(diff) - diff - 1.0
    if sample_advantages is None:
        r = rewards.reshape(-1).float()
        if samples_per_prompt is not None:
            group = torch.arange(r.numel()) // samples_per_prompt
        else:
            bounds = torch.as_tensor(group_boundaries)
            group = torch.repeat_interleave(torch.arange(bounds.numel() - 1), bounds[1:] - bounds[:-1])
        n = int(group.max()) + 1
        counts = r.new_zeros(n).index_add_(0, group, torch.ones_like(r))
        means = r.new_zeros(n).index_add_(0, group, r) / counts
        variance = r.new_zeros(n).index_add_(0, group, r * r) / counts - means * means
        sample_advantages = (r - means[group]) / variance.clamp_min(eps ** 2).sqrt()[group]
    adv = sample_advantages.reshape(-1, 1).expand_as(mask).clone().masked_fill(~mask, 0.0).float()
    policy_terms = -torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv)
    denom = mask.sum().to(torch.float32).clamp_min(1e-8)
    policy_loss = policy_terms.masked_fill(~mask, 0.0).sum() / denom
    kl = kl_terms.masked_fill(~mask, 0.0).sum() / denom
    return policy_loss + beta * kl


def _reduce(per_token_loss, mask, loss_type, max_completion_length, batch):
    """TRL's `_compute_loss` / Liger's `_reduce_loss` reductions, one process (dapo: the batch's active tokens)."""
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (batch * max_completion_length)
    if loss_type == "dapo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    raise ValueError(loss_type)


def liger(logits, old_logp, ref_logp, completion_ids, advantages, completion_mask=None, temperature=0.9, beta=0.04,
          eps_low=0.2, eps_high=0.4, loss_type="dapo", max_completion_length=None):
    """triton_grpo_loss(..., reduce=True): logits [B, L+1, V] (the last position unused) divided by the temperature
    in fp32; per-token -min(c1 A, clamp(c1) A) + beta k3; `_reduce_loss` (dr_grpo's length defaults to L). Also
    returns (kl_mean, clip_ratio) as its metrics."""
    L = logits.shape[1] - 1
    logp = _select(logits[:, :-1].float() / temperature, completion_ids)
    old = logp.detach() if old_logp is None else old_logp
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    adv = advantages.float().unsqueeze(1)
    per_token_loss = -torch.minimum(coef_1 * adv, coef_2 * adv)
    is_clipped = ((coef_1 < 1 - eps_low) & (adv < 0)) | ((coef_1 > 1 + eps_high) & (adv > 0))
    mask = completion_mask.float()
    kl = torch.zeros_like(logp)
    if beta != 0.0:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
        per_token_loss = per_token_loss + beta * kl
    loss = _reduce(per_token_loss, mask, loss_type, max_completion_length or L, logits.shape[0])
    tokens = mask.sum().clamp(min=1.0)
    return loss, ((kl * mask).sum() / tokens).detach(), ((is_clipped * mask).sum() / tokens).detach()


def trl_advantages(rewards, num_generations):
    """`scale_rewards="group"`: (r - group mean) / (group std, Bessel, + 1e-4)."""
    grouped = rewards.view(-1, num_generations)
    mean = grouped.mean(dim=1).repeat_interleave(num_generations, dim=0)
    std = grouped.std(dim=1).repeat_interleave(num_generations, dim=0)
    return (rewards - mean) / (std + 1e-4)


def trl(logits, ref_logits, completion_ids, old_per_token_logps, advantages, completion_mask, *, temperature=1.0,
        beta=0.0, epsilon_low=0.2, epsilon_high=0.2, loss_type="dapo", max_completion_length=None,
        use_bias_correction_kl=False, delta=None):
    """GRPOTrainer._compute_loss (token-level importance sampling): logits / temperature, selective log-softmax,
    k3 KL (times c1 when bias-corrected), -min(min(c1, delta) A, clamp(c1) A) + beta kl, then the loss_type's
    reduction. Also returns the logged `kl` (token mean) and `clip_ratio/region_mean`."""
    per_token_logps = _select(logits / temperature, completion_ids)
    with torch.no_grad():
        ref_per_token_logps = _select(ref_logits / temperature, completion_ids)
    per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
    coef_1 = torch.exp(per_token_logps - old_per_token_logps)
    if use_bias_correction_kl:
        per_token_kl = per_token_kl * coef_1
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    unclipped = coef_1 if delta is None else torch.clamp(coef_1, max=delta)
    per_token_loss = -torch.min(unclipped * advantages.unsqueeze(1), coef_2 * advantages.unsqueeze(1))
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    mask = completion_mask.float()
    loss = _reduce(per_token_loss, mask, loss_type, max_completion_length, per_token_loss.size(0))
    tokens = mask.sum().clamp(min=1.0)
    is_region_clipped = (((coef_1 < 1 - epsilon_low) & (advantages.unsqueeze(1) < 0))
                         | ((coef_1 > 1 + epsilon_high) & (advantages.unsqueeze(1) > 0)))
    return loss, ((per_token_kl * mask).sum() / tokens).detach(), ((is_region_clipped * mask).sum() / tokens).detach()


def verl_grpo_advantages(scores, index, epsilon=1e-6):
    """compute_grpo_outcome_advantage (norm_adv_by_std_in_grpo): (score - mean) / (Bessel std + epsilon)."""
    out = scores.clone()
    for g in index.unique():
        sel = index == g
        out[sel] = (scores[sel] - scores[sel].mean()) / (scores[sel].std() + epsilon)
    return out


def verl(logits, ref_logits, responses, old_log_prob, advantages, response_mask, *, temperature=1.0,
         clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, use_kl_loss=True, kl_loss_coef=0.001,
         loss_agg_mode="token-mean"):
    """The actor's loss: compute_policy_loss_vanilla (dual-clip PPO, ratio exponent clamped at +-20) + kl_loss_coef
    * agg_loss(kl_penalty(low_var_kl)), logits divided by the temperature, advantages [B, T]."""
    mask = response_mask.float()

    def agg_loss(loss_mat):
        if loss_agg_mode == "token-mean":
            return (loss_mat * mask).sum() / (mask.sum() + 1e-8)
        if loss_agg_mode == "seq-mean-token-sum":
            return torch.mean(torch.sum(loss_mat * mask, dim=-1))
        if loss_agg_mode == "seq-mean-token-mean":
            return torch.mean(torch.sum(loss_mat * mask, dim=-1) / torch.sum(mask, dim=-1))
        if loss_agg_mode == "seq-mean-token-sum-norm":
            return torch.sum(torch.sum(loss_mat * mask, dim=-1)) / mask.shape[-1]
        raise ValueError(loss_agg_mode)

    log_prob = _select(logits / temperature, responses)
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    clip_pg_losses2 = torch.min(-advantages * clip_ratio_c, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    loss = agg_loss(pg_losses)
    if use_kl_loss:
        with torch.no_grad():
            ref_log_prob = _select(ref_logits / temperature, responses)
        kl = torch.clamp(ref_log_prob - log_prob, min=-20, max=20)
        kld = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
        loss = loss + agg_loss(kld) * kl_loss_coef
    return loss


# ---------------------------------------------------------------------------------------------------------------
# The grid.

def grid_inputs(seed: int, dtype: torch.dtype, temperature: float, width: int = 1) -> dict:
    """Logits (with `width` extra positions at the end, Liger's L + 1), ids, a mask with holes and the empty
    sequences EMPTY, distinct rewards, and old log-probs within +-0.6 of the tempered log-probs (ratios in about
    [0.55, 1.8]: both sides of the clip range, never near verl's dual-clip bound 3)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T + width, V, generator=g) * 2).to(dtype)
    ref_logits = (logits.float() + 0.3 * torch.randn(B, T + width, V, generator=g)).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) < 0.75
    mask[:, 0] = True
    mask[list(EMPTY)] = False
    lp = _select(logits[:, :T].float() / temperature, ids)
    old = (lp + (torch.rand(B, T, generator=g) * 1.2 - 0.6)).detach()
    rewards = torch.randn(B, generator=g)
    return dict(logits=logits, ref_logits=ref_logits, ids=ids, mask=mask, old=old, rewards=rewards)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _diff(ours, theirs, what) -> float:
    """Largest |difference| relative to the peer's largest magnitude (scalars: relative to the value)."""
    scale = max(theirs.detach().abs().max().item(), 1e-6)
    return (ours.detach().double() - theirs.detach().double()).abs().max().item() / scale


def compare(ours_fn, theirs_fn, logits) -> tuple[float, float]:
    a, b = leaf(logits), leaf(logits)
    ours, theirs = ours_fn(a), theirs_fn(b)
    ours.backward()
    theirs.backward()
    return _diff(ours, theirs, "loss"), _diff(a.grad, b.grad, "grad")


GROUPINGS = {"uniform": dict(samples_per_prompt=UNIFORM), "csr": dict(group_boundaries=CSR)}
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]
VERL_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def rl_kernel_cases(backend=None):
    for seed, (grouping, beta, dtype, given) in enumerate(itertools.product(
            GROUPINGS, (0.0, 0.04), (torch.float32, torch.bfloat16), (False, True))):
        inp = grid_inputs(seed, dtype, 1.0, width=0)
        env = dict(ref_logits=inp["ref_logits"], action_ids=inp["ids"], old_logps=inp["old"], rewards=inp["rewards"],
                   completion_mask=inp["mask"], clip_eps=0.2, beta=beta, **GROUPINGS[grouping])
        env.setdefault("samples_per_prompt", None)
        env.setdefault("group_boundaries", None)
        peer_kw = dict(clip_eps=0.2, beta=beta, samples_per_prompt=env["samples_per_prompt"],
                       group_boundaries=env["group_boundaries"])
        if given:
            env["sample_advantages"] = torch.randn(B, generator=torch.Generator().manual_seed(seed))
            peer_kw["sample_advantages"] = env["sample_advantages"]
        name = "rl-kernel-advantages" if given else "rl-kernel"
        yield (f"{name} {grouping} beta={beta} {str(dtype)[6:]}",
               lambda x, env=env, name=name: run_snippet(name, {**env, "policy_logits": x}, backend),
               lambda x, inp=inp, kw=peer_kw: rl_kernel(x, inp["ref_logits"], inp["ids"], inp["old"], inp["rewards"],
                                                         inp["mask"], **kw),
               inp["logits"])


def liger_cases(backend=None):
    for seed, (loss_type, beta, temperature, dtype) in enumerate(itertools.product(
            LOSS_TYPES, (0.0, 0.04), (1.0, 0.7), (torch.float32, torch.bfloat16))):
        inp = grid_inputs(100 + seed, dtype, temperature, width=1)
        ref_logp = _select(inp["ref_logits"][:, :-1].float() / temperature, inp["ids"])  # fused_selective_log_softmax
        adv = torch.randn(B, generator=torch.Generator().manual_seed(seed))
        max_len = 16 if loss_type == "dr_grpo" and seed % 2 else None
        env = dict(ref_logp=ref_logp, old_logp=inp["old"], completion_ids=inp["ids"], advantages=adv,
                   completion_mask=inp["mask"], temperature=temperature, beta=beta, eps_low=0.2, eps_high=0.28,
                   loss_type=loss_type, max_completion_length=max_len)
        yield (f"liger {loss_type} beta={beta} T={temperature} {str(dtype)[6:]}",
               lambda x, env=env: run_snippet("liger", {**env, "logits": x}, backend),
               lambda x, inp=inp, env=env, ref_logp=ref_logp: liger(
                   x, inp["old"], ref_logp, inp["ids"], env["advantages"], inp["mask"], temperature=temperature,
                   beta=beta, eps_low=0.2, eps_high=0.28, loss_type=loss_type, max_completion_length=max_len)[0],
               inp["logits"])


def trl_cases(backend=None):
    for seed, (loss_type, beta, temperature, given) in enumerate(itertools.product(
            LOSS_TYPES, (0.0, 0.04), (1.0, 0.7), (False, True))):
        inp = grid_inputs(200 + seed, torch.float32, temperature, width=0)
        advantages = trl_advantages(inp["rewards"], UNIFORM)
        max_len = 16 if loss_type == "dr_grpo" else None
        env = dict(ref_logits=inp["ref_logits"], completion_ids=inp["ids"], old_per_token_logps=inp["old"],
                   ref_per_token_logps=_select(inp["ref_logits"] / temperature, inp["ids"]),
                   completion_mask=inp["mask"], rewards=inp["rewards"], num_generations=UNIFORM,
                   advantages=advantages, temperature=temperature, beta=beta, epsilon_low=0.2, epsilon_high=0.28,
                   loss_type=loss_type, max_completion_length=max_len, use_bias_correction_kl=given,
                   delta=1.1 if given else None)  # TRL 1.16's defaults: True, None
        name = "trl-advantages" if given else "trl"
        yield (f"{name} {loss_type} beta={beta} T={temperature}",
               lambda x, env=env, name=name: run_snippet(name, {**env, "logits": x}, backend),
               lambda x, inp=inp, adv=advantages: trl(x, inp["ref_logits"], inp["ids"], inp["old"], adv, inp["mask"],
                                                      temperature=temperature, beta=beta, epsilon_low=0.2,
                                                      epsilon_high=0.28, loss_type=loss_type,
                                                      max_completion_length=max_len, use_bias_correction_kl=given,
                                                      delta=1.1 if given else None)[0],
               inp["logits"])


def verl_cases(backend=None):
    for seed, (mode, kl_coef, temperature, grouping) in enumerate(itertools.product(
            VERL_MODES, (0.0, 0.04), (1.0, 0.7), GROUPINGS)):
        inp = grid_inputs(300 + seed, torch.float32, temperature, width=0)
        if mode == "seq-mean-token-mean":  # verl divides by the count unclamped: an empty sequence is NaN there
            inp["mask"][list(EMPTY), 0] = True
        bounds = torch.tensor(CSR if grouping == "csr" else (0, 4, 8))
        index = torch.repeat_interleave(torch.arange(len(bounds) - 1), bounds[1:] - bounds[:-1])
        advantages = verl_grpo_advantages(inp["rewards"], index).unsqueeze(-1) * inp["mask"]
        env = dict(ref_logits=inp["ref_logits"], responses=inp["ids"], old_log_prob=inp["old"],
                   advantages=advantages, response_mask=inp["mask"], temperature=temperature, clip_ratio_low=0.2,
                   clip_ratio_high=0.28, use_kl_loss=kl_coef > 0, kl_loss_coef=kl_coef, loss_agg_mode=mode)
        yield (f"verl {mode} kl_coef={kl_coef} T={temperature} {grouping}",
               lambda x, env=env: run_snippet("verl", {**env, "logits": x}, backend),
               lambda x, inp=inp, adv=advantages: verl(
                   x, inp["ref_logits"], inp["ids"], inp["old"], adv, inp["mask"], temperature=temperature,
                   clip_ratio_low=0.2, clip_ratio_high=0.28, use_kl_loss=kl_coef > 0, kl_loss_coef=kl_coef,
                   loss_agg_mode=mode),
               inp["logits"])


PEERS = {"rl-kernel": rl_kernel_cases, "liger": liger_cases, "trl": trl_cases, "verl": verl_cases}
TOLERANCE = {"loss": 2e-5, "grad": 2e-5}  # relative to the peer's largest magnitude


def measure(peer: str) -> dict:
    worst = {"loss": (0.0, ""), "grad": (0.0, "")}
    for label, ours, theirs, logits in PEERS[peer]():
        for what, d in zip(("loss", "grad"), compare(ours, theirs, logits)):
            if d > worst[what][0]:
                worst[what] = (d, label)
    return worst


@pytest.mark.parametrize("peer", PEERS)
def test_readme_migration_line_gives_the_peers_numbers(peer):
    worst = measure(peer)
    for what, (d, label) in worst.items():
        assert d <= TOLERANCE[what], f"{peer}: {what} differs by {d:.2e} (relative) at {label}"


@pytest.mark.parametrize("peer", PEERS)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the grid is CPU tensors, which Triton runs under the "
                                                        "interpreter only (test_triton_grpo_loss covers CUDA)")
def test_readme_migration_line_on_triton_gives_the_peers_numbers(peer):
    """The same lines on the Triton backend (the interpreter: one fp32 case in five; a bf16 gradient is rounded
    from fp32 by the kernel, not by torch's autograd as the peers' is: test_triton_grpo_loss compares it)."""
    pytest.importorskip("triton")
    fp32 = compared = 0
    for label, ours, theirs, logits in PEERS[peer]("triton"):  # lazily: the peers' lambdas read the loop's names
        fp32 += "bfloat16" not in label
        if "bfloat16" in label or fp32 % 5 != 1:
            continue
        compared += 1
        for what, d in zip(("loss", "grad"), compare(ours, theirs, logits)):
            assert d <= TOLERANCE[what], f"{peer} on triton: {what} differs by {d:.2e} (relative) at {label}"
    assert compared >= 2


def test_every_migration_block_is_tested():
    assert sorted(snippets()) == ["liger", "rl-kernel", "rl-kernel-advantages", "trl", "trl-advantages", "verl"]


def test_the_grid_is_not_vacuous():
    """The loss types and temperatures give different numbers on the grid, its ratios straddle the clip range,
    and verl's dual clip never binds (which the README says we do not have)."""
    inp = grid_inputs(0, torch.float32, 1.0, width=1)
    adv = torch.randn(B, generator=torch.Generator().manual_seed(0))
    ref_logp = _select(inp["ref_logits"][:, :-1], inp["ids"])
    losses = {lt: liger(inp["logits"], inp["old"], ref_logp, inp["ids"], adv, inp["mask"], temperature=1.0,
                        loss_type=lt, max_completion_length=T)[0].item() for lt in LOSS_TYPES}
    assert len(set(losses.values())) == 3 and losses["bnpo"] == losses["dapo"], losses  # one process: bnpo == dapo
    ratio = torch.exp(_select(inp["logits"][:, :T], inp["ids"]) - inp["old"])[inp["mask"]]
    assert ratio.min() < 0.8 and ratio.max() > 1.28 and ratio.max() < 3.0


@pytest.mark.parametrize("peer", ["trl", "liger"])
def test_contract_path_metrics_are_the_logged_ones(peer):
    """`result.kl_token_mean` is TRL's / Liger's logged kl, `result.clip_fraction` their clip ratio."""
    for temperature in (1.0, 0.7):
        inp = grid_inputs(400, torch.float32, temperature, width=0)
        adv = torch.randn(B, generator=torch.Generator().manual_seed(1))
        contract = GRPOLossContract(num_sequences=B, padded_seq_len=T, vocab_size=V, clip_eps=0.2, clip_eps_high=0.28,
                                    beta=0.04, temperature=temperature, advantages_input="sequence", loss_type="dapo")
        res = kernel_registry.get_loss_op(contract).op.apply(
            inp["logits"], inp["ids"], inp["old"], contract=contract, completion_mask=inp["mask"],
            ref_local_logits=inp["ref_logits"], advantages=adv)
        if peer == "trl":
            loss, kl, clip = trl(inp["logits"], inp["ref_logits"], inp["ids"], inp["old"], adv, inp["mask"],
                                 temperature=temperature, beta=0.04, epsilon_low=0.2, epsilon_high=0.28)
        else:
            ext = {k: torch.cat([inp[k], inp[k][:, -1:]], 1) for k in ("logits", "ref_logits")}  # L + 1 positions
            ref_logp = _select(inp["ref_logits"] / temperature, inp["ids"])
            loss, kl, clip = liger(ext["logits"], inp["old"], ref_logp, inp["ids"], adv, inp["mask"],
                                   temperature=temperature, beta=0.04, eps_low=0.2, eps_high=0.28)
        assert abs(res.loss.item() - loss.item()) <= 2e-5 * abs(loss.item())  # their reported loss holds beta * kl
        assert abs(res.kl_token_mean.item() - kl.item()) <= 2e-5 * abs(kl.item())
        assert abs(res.clip_fraction.item() - clip.item()) <= 1e-7 and 0 < clip.item() < 1


if __name__ == "__main__":
    for peer in PEERS:
        for what, (d, label) in measure(peer).items():
            print(f"{peer:10s} {what:5s} {d:.2e}  ({label})")
