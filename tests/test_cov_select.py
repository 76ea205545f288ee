"""``covariance_mask`` (``lightning_kl.cov_select``): KL-Cov's and Clip-Cov's tokens, against verl 0.9.1's own ``compute_policy_loss_kl_cov``
/ ``_clip_cov`` (run from the installed package, ``tests/_verl_losses.py``) on one process, against exact
dyadic arithmetic at ties and at the window's bounds, and on 2 and 3 gloo processes against one process
on the concatenated batch (``tests/_cov_select_worker.py``)."""

from __future__ import annotations

import ast
import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.cov_select import covariance_mask
from _ddp import run_ddp_worker
from _snippets import snippet
from lightning_kl.cov_select import DEFAULT_CLIP, DEFAULT_FRACTION, DEFAULT_WINDOW, clipped_by_ppo

WORKER_PATH = Path(__file__).with_name("_cov_select_worker.py")
_spec = importlib.util.spec_from_file_location("_cov_select_worker", WORKER_PATH)
assert _spec is not None and _spec.loader is not None
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def _data(seed: int, b: int = 12, t: int = 40) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g) * 6
    old = (lp + 0.3 * torch.randn(b, t, generator=g)).clamp(max=0.0)
    adv = (2 * torch.randn(b, 1, generator=g)).expand(b, t) + 0.5 * torch.randn(b, t, generator=g)
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    mask = torch.arange(t) < lengths[:, None]
    return {"lp": lp, "old": old, "adv": adv.contiguous(), "mask": mask}


def _verl(kind: str, d: dict[str, torch.Tensor], **policy_loss: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """verl's loss, its gradient in the current log-probs, and the tokens it treated apart (read off the
    gradient: KL-Cov's coefficient is large, Clip-Cov's treated tokens have none)."""
    from _verl_losses import load_verl_losses, verl_config

    lp = d["lp"].clone().requires_grad_()
    loss, _ = load_verl_losses()[kind](
        old_log_prob=d["old"], log_prob=lp, advantages=d["adv"], response_mask=d["mask"].float(),
        loss_agg_mode="token-mean", config=verl_config(policy_loss=policy_loss),
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, lp)
    n = d["mask"].sum()
    ratio = torch.exp(d["lp"] - d["old"])
    if kind == "kl_cov":
        c = policy_loss["ppo_kl_coef"]
        treated = ((grad * n + d["adv"] * ratio).abs() > c / 2) & d["mask"]
    else:
        free = ~clipped_by_ppo(d["lp"], d["old"], d["adv"], 0.2, 0.2) & (d["adv"] != 0)
        treated = (grad == 0) & free & d["mask"]
    return loss.detach(), grad, treated


@pytest.mark.parametrize("fraction", [1e-9, 0.01, 0.1, 0.5, 1.0])
def test_kl_cov_chooses_verls_tokens_and_gives_its_loss(fraction: float) -> None:
    d = _data(seed=1)
    coef = 1000.0
    want_loss, want_grad, want = _verl("kl_cov", d, kl_cov_ratio=fraction, ppo_kl_coef=coef)
    got = covariance_mask(d["lp"], d["adv"], d["mask"], loss_mode="kl_cov", fraction=fraction)
    n = int(d["mask"].sum())
    assert int(got.sum()) == max(1, int(n * fraction))  # 1e-9: floor(fraction * n) = 0, still one token
    assert torch.equal(got, want)
    lp = d["lp"].clone().requires_grad_()
    ratio = torch.exp(lp - d["old"])
    loss = lk.aggregate(-d["adv"] * ratio + coef * (lp - d["old"]).abs() * got, d["mask"], "token-mean")
    (grad,) = torch.autograd.grad(loss, lp)
    assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    assert_close(grad, want_grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fraction,window", [(0.02, (1.0, 5.0)), (1.0, (1.0, 5.0)), (0.05, (-2.0, 0.5))])
def test_clip_cov_chooses_verls_tokens_with_the_same_random_state(fraction: float, window: tuple[float, float]) -> None:
    d = _data(seed=2)
    torch.manual_seed(7)
    want_loss, want_grad, want = _verl("clip_cov", d, clip_cov_ratio=fraction, clip_cov_lb=window[0], clip_cov_ub=window[1])
    torch.manual_seed(7)
    got = covariance_mask(d["lp"], d["adv"], d["mask"], loss_mode="clip_cov", fraction=fraction,
                             old_logprob=d["old"], window=window)  # fmt: skip
    assert torch.equal(got, want)
    assert 0 < int(got.sum())
    if fraction < 1:  # fewer chosen than candidates: the permutation decides, so the random state matters
        torch.manual_seed(8)
        other = covariance_mask(d["lp"], d["adv"], d["mask"], loss_mode="clip_cov", fraction=fraction,
                                   old_logprob=d["old"], window=window)  # fmt: skip
        assert int(other.sum()) == int(got.sum()) and not torch.equal(other, got)
    lp = d["lp"].clone().requires_grad_()
    ratio = torch.exp(lp - d["old"])
    surrogate = torch.maximum(-d["adv"] * ratio, -d["adv"] * ratio.clamp(0.8, 1.2))
    loss = lk.aggregate(surrogate * ~got, d["mask"], "token-mean")
    (grad,) = torch.autograd.grad(loss, lp)
    assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    assert_close(grad, want_grad, rtol=1e-6, atol=1e-7)


def test_the_docs_recipes_equal_verls_losses() -> None:
    code = snippet("docs/mismatch.md", "loss_mode=\"kl_cov\"")
    d = _data(seed=4, b=30, t=200)  # about 3000 tokens: fraction 0.0002 selects max(1, 0) = 1
    d["adv"] = d["adv"][:, :1].contiguous()  # one advantage per sequence, as batch["advantages"]
    d_tok = dict(d, adv=d["adv"].expand_as(d["lp"]))
    lp = d["lp"].clone().requires_grad_()
    ns = {"torch": torch, "lk": lk, "logprob": lp, "old_logprob": d["old"], "mask": d["mask"], "eps": 0.2,
          "batch": {"advantages": d["adv"][:, 0]}}  # fmt: skip
    torch.manual_seed(3)
    exec(compile(code, "<docs/mismatch.md>", "exec"), ns)
    kl_loss, _, _ = _verl("kl_cov", d_tok, ppo_kl_coef=0.1)
    torch.manual_seed(3)
    clip_loss, _, _ = _verl("clip_cov", d_tok)
    assert_close(ns["kl_cov_loss"], kl_loss, rtol=1e-6, atol=1e-6)
    assert_close(ns["clip_cov_loss"], clip_loss, rtol=1e-6, atol=1e-6)
    assert int(ns["penalized"].sum()) == 1 and int(ns["dropped"].sum()) == 1


def test_ties_at_the_kth_covariance_go_to_the_first_tokens_exactly_k_of_them() -> None:
    # dyadic values: the means and products are exact in any summation order
    lp = torch.tensor([[-1.0, -3.0, -1.0, -3.0, -2.0, -2.0, -1.0, -3.0]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 0.0, 0.0, 1.0, -1.0]])
    # means -2 and 0: c = 1 on the six tokens of lp -1 / -3, 0 on the two of lp -2
    mask = torch.ones_like(lp, dtype=torch.bool)
    got = covariance_mask(lp, adv, mask, loss_mode="kl_cov", fraction=0.25)  # k = 2 of six tied
    assert got.tolist() == [[True, True, False, False, False, False, False, False]]
    got = covariance_mask(lp, adv, mask, loss_mode="kl_cov", fraction=0.875)  # k = 7: the six, then a 0
    assert got.tolist() == [[True, True, True, True, True, False, True, True]]


def test_clip_cov_window_is_strict_at_both_bounds() -> None:
    lp = torch.tensor([[-1.0, -3.0, -1.0, -3.0]], dtype=torch.float64)  # deviations 1, -1, 1, -1 from -2
    adv = torch.tensor([[3.0, -1.0, -1.0, -1.0]], dtype=torch.float64)  # mean 0: c = 3, 1, -1, 1
    m = torch.ones_like(lp, dtype=torch.bool)
    kw = {"loss_mode": "clip_cov", "fraction": 1.0, "old_logprob": lp}  # ratio 1: nothing clipped
    assert covariance_mask(lp, adv, m, window=(1.0, 5.0), **kw).tolist() == [[True, False, False, False]]
    assert covariance_mask(lp, adv, m, window=(math.nextafter(1.0, 0), 5.0), **kw).tolist() == [[True, True, False, True]]
    assert covariance_mask(lp, adv, m, window=(0.0, 3.0), **kw).tolist() == [[False, True, False, True]]
    assert covariance_mask(lp, adv, m, window=(0.0, math.nextafter(3.0, 4)), **kw).tolist() == [[True, True, False, True]]
    # no candidate in the window: nothing, whatever the fraction
    assert not covariance_mask(lp, adv, m, window=(3.0, 4.0), **kw).any()


def test_clip_cov_leaves_out_the_tokens_ppo_already_clips() -> None:
    lp = torch.tensor([[-1.0, -3.0, -1.0, -3.0]])
    adv = torch.tensor([[3.0, -1.0, -1.0, -1.0]])
    old = lp.clone()
    old[0, 0] = -2.0  # ratio e for A = 3 > 0: above 1 + 0.2, PPO clips it
    m = torch.ones_like(lp, dtype=torch.bool)
    got = covariance_mask(lp, adv, m, loss_mode="clip_cov", fraction=1.0, old_logprob=old, window=(0.5, 5.0))
    assert got.tolist() == [[False, True, False, True]]
    wide = covariance_mask(lp, adv, m, loss_mode="clip_cov", fraction=1.0, old_logprob=old, window=(0.5, 5.0), clip=(0.2, 2.0))
    assert wide.tolist() == [[True, True, False, True]]


def test_padding_is_never_read_and_nan_at_a_valid_token_selects_nothing() -> None:
    d = _data(seed=5)
    want = covariance_mask(d["lp"], d["adv"], d["mask"], loss_mode="kl_cov", fraction=0.1)
    lp, adv = d["lp"].clone(), d["adv"].clone()
    lp[~d["mask"]] = math.nan
    adv[~d["mask"]] = math.inf
    assert torch.equal(covariance_mask(lp, adv, d["mask"], loss_mode="kl_cov", fraction=0.1), want)
    assert not (want & ~d["mask"]).any()
    i = d["mask"].nonzero()[3]
    lp[i[0], i[1]] = math.nan
    for kw in ({"loss_mode": "kl_cov"}, {"loss_mode": "clip_cov", "old_logprob": d["old"], "window": (-1e9, 1e9)}):
        assert not covariance_mask(lp, adv, d["mask"], fraction=1.0, **kw).any()


def test_no_valid_token_selects_nothing_and_shapes_follow_the_input() -> None:
    lp = torch.full((2, 3), -1.0)
    none = torch.zeros(2, 3, dtype=torch.bool)
    assert covariance_mask(lp, torch.ones(2), none, loss_mode="kl_cov").tolist() == none.tolist()
    assert covariance_mask(lp[:0], torch.ones(0), loss_mode="kl_cov").shape == (0, 3)
    out = covariance_mask(lp[None], torch.ones(1, 2, 1), loss_mode="clip_cov", old_logprob=lp[None])
    assert out.shape == (1, 2, 3) and out.dtype == torch.bool


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"loss_mode": "kl"}, r"unknown `loss_mode` 'kl'; valid values: 'kl_cov', 'clip_cov'"),
        ({"loss_mode": "kl_cov", "fraction": 0.0}, r"`fraction` must be a fraction of the valid tokens in \(0, 1\]"),
        ({"loss_mode": "kl_cov", "fraction": 1.5}, r"in \(0, 1\]"),
        ({"loss_mode": "kl_cov", "fraction": True}, r"in \(0, 1\]"),
        ({"loss_mode": "kl_cov", "window": (1.0, 5.0)}, r"loss_mode='kl_cov' reads no `window`"),
        ({"loss_mode": "kl_cov", "old_logprob": torch.zeros(2, 3)}, r"loss_mode='kl_cov' reads no `old_logprob`"),
        ({"loss_mode": "clip_cov"}, r"loss_mode='clip_cov' needs `old_logprob`"),
        ({"loss_mode": "clip_cov", "old_logprob": torch.zeros(2, 3), "window": (5.0, 1.0)}, r"lower < upper"),
        ({"loss_mode": "clip_cov", "old_logprob": torch.zeros(2, 3), "clip": -0.1}, r"`clip` must be PPO's clip ratio"),
        ({"loss_mode": "clip_cov", "old_logprob": torch.zeros(2, 4)}, r"`old_logprob` \(2, 4\) must have the shape"),
    ],
)
def test_bad_settings_and_inputs_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        covariance_mask(torch.full((2, 3), -1.0), torch.ones(2), **kwargs)
    with pytest.raises(ValueError, match=r"`advantages` must be \[...\], \[..., 1\] or \[..., t\] for log-probs \(2, 3\), got \(3,\)"):
        covariance_mask(torch.full((2, 3), -1.0), torch.ones(3), loss_mode="kl_cov")


def test_the_defaults_are_verls() -> None:
    from _mismatch_stacks import package_root

    tree = ast.parse((package_root("verl") / "workers" / "config" / "actor.py").read_text())
    defaults = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name in ("PolicyLossConfig", "ActorConfig"):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and isinstance(item.value, ast.Constant):
                    defaults[item.target.id] = item.value.value
    assert defaults["kl_cov_ratio"] == defaults["clip_cov_ratio"] == DEFAULT_FRACTION
    assert (defaults["clip_cov_lb"], defaults["clip_cov_ub"]) == DEFAULT_WINDOW
    assert defaults["clip_ratio"] == defaults["clip_ratio_low"] == defaults["clip_ratio_high"] == DEFAULT_CLIP
    assert defaults["ppo_kl_coef"] == 0.1  # docs/mismatch.md's table; the loss itself reads 1.0 for None


# --- 2 and 3 gloo processes ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 3])
def records(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    world = request.param
    out = run_ddp_worker(WORKER_PATH, tmp_path_factory.mktemp(f"cov_select_{world}"), str(world), world=world, timeout=240)
    for r in out:
        assert "failure" not in r, r["failure"]
    return out


def _concatenated(world: int, kind: str) -> dict[str, torch.Tensor]:
    parts = [worker.rank_data(world, r, kind) for r in range(world)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


@pytest.mark.parametrize("case", sorted(worker.CASES))
def test_every_rank_holds_its_share_of_one_processs_choice_on_the_concatenated_batch(
    records: list[dict[str, Any]], case: str
) -> None:
    world = len(records)
    kind, kwargs = worker.CASES[case]
    d = _concatenated(world, kind)
    torch.manual_seed(worker.SEED)  # rank 0's random state: the permutation is drawn there
    want = worker.select(d, kwargs)
    rows = 0
    for r, record in enumerate(records):
        got = torch.tensor(record["masks"][case], dtype=torch.bool)
        assert torch.equal(got, want[rows : rows + got.shape[0]]), (case, r)
        rows += got.shape[0]
    assert rows == want.shape[0]
    if kind != "empty_all":
        assert want.any()
    if case == "ties, kl_cov":  # every covariance ties; k = n / 2 is more than rank 0 holds: the first tokens win
        flat = [x for record in records for row in record["masks"][case] for x in row]
        k = max(1, int(len(flat) * kwargs["fraction"]))
        assert k > len(records[0]["masks"][case]) * worker.T and flat == [True] * k + [False] * (len(flat) - k)


def test_the_count_is_the_global_one_not_a_sum_of_per_rank_counts(records: list[dict[str, Any]]) -> None:
    world = len(records)
    d = _concatenated(world, "unequal")
    n = int(d["mask"].sum())
    total = sum(int(torch.tensor(r["masks"]["unequal, kl_cov 0.01"]).sum()) for r in records)
    assert total == max(1, int(n * 0.01))
    per_rank = sum(max(1, int(int(worker.rank_data(world, r, "unequal")["mask"].sum()) * 0.01)) for r in range(world)
                   if worker.rank_data(world, r, "unequal")["mask"].any())  # fmt: skip
    assert per_rank != total  # verl's per-process count would differ here


def test_an_input_refused_on_one_rank_raises_on_every_rank(records: list[dict[str, Any]]) -> None:
    messages = [r["raised"] for r in records]
    assert all(m is not None for m in messages), messages
    assert len(set(messages)) == 1
    assert f"found on rank {len(records) - 1}" in messages[0] and "`advantages` must be" in messages[0]
    assert all(r["after"] for r in records)  # the collectives still pair up after the refusal


def _split_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    b, t = 64, 256
    lp = -torch.rand(b, t, generator=g) * 6
    old = (lp + 0.3 * torch.randn(b, t, generator=g)).clamp(max=0.0)
    adv = ((2 * torch.randn(b, 1, generator=g)).expand(b, t) + 0.5 * torch.randn(b, t, generator=g)).contiguous()
    mask = torch.arange(t) < torch.randint(16, t + 1, (b,), generator=g)[:, None]
    return {"lp": lp, "old": old, "adv": adv, "mask": mask}


@pytest.mark.parametrize(
    "fraction,micro,want_global,want_verl,want_overlap",
    [(0.0002, 4, 1, 16, 1), (0.0002, 16, 1, 4, 1), (0.002, 4, 15, 16, 1), (0.02, 16, 157, 156, 88)],
)
def test_verls_per_micro_batch_choice_depends_on_the_split_as_docs_say(
    fraction: float, micro: int, want_global: int, want_verl: int, want_overlap: int
) -> None:
    # docs/mismatch.md's table: 64 sequences, 7851 valid tokens, verl's kl_cov on micro-batches of
    # `micro` sequences against one choice over the whole batch
    d = _split_batch()
    assert int(d["mask"].sum()) == 7851
    whole = covariance_mask(d["lp"], d["adv"], d["mask"], loss_mode="kl_cov", fraction=fraction)
    parts = [_verl("kl_cov", {k: v[i : i + micro] for k, v in d.items()}, kl_cov_ratio=fraction, ppo_kl_coef=1000.0)[2]
             for i in range(0, 64, micro)]  # fmt: skip
    per = torch.cat(parts)
    assert (int(whole.sum()), int(per.sum()), int((per & whole).sum())) == (want_global, want_verl, want_overlap)


def test_clip_cov_draws_its_permutation_from_the_generator_given() -> None:
    d = _data(seed=2)
    kw = {"loss_mode": "clip_cov", "fraction": 0.02, "old_logprob": d["old"]}
    a = covariance_mask(d["lp"], d["adv"], d["mask"], generator=torch.Generator().manual_seed(5), **kw)
    torch.manual_seed(0)
    b = covariance_mask(d["lp"], d["adv"], d["mask"], generator=torch.Generator().manual_seed(5), **kw)
    torch.manual_seed(5)
    c = covariance_mask(d["lp"], d["adv"], d["mask"], **kw)  # the global generator in the same state
    other = covariance_mask(d["lp"], d["adv"], d["mask"], generator=torch.Generator().manual_seed(6), **kw)
    assert torch.equal(a, b) and torch.equal(a, c) and not torch.equal(a, other)


def test_an_explicit_group_wins_over_the_world(records: list[dict[str, Any]]) -> None:
    world = len(records)
    for members in worker.GROUPS[world]:
        parts = [worker.rank_data(world, r, "unequal") for r in members]
        d = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        torch.manual_seed(worker.seed(members[0]))  # the group's first process draws the permutation
        want = worker.select(d, worker.EXPLICIT)
        got = torch.cat([torch.tensor(records[r]["explicit"], dtype=torch.bool) for r in members])
        assert torch.equal(got, want), members
        assert want.any()
