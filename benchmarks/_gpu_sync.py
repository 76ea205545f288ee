"""The sync-debug list of ``benchmarks/gpu.py``: every public call, how to make its inputs, and
whether it is expected to make the host wait for the device today (and why).

:func:`check_sync` runs one call under ``torch.cuda.set_sync_debug_mode("error")``;
:func:`coverage` says which public names no call covers. On CPU the calls run unchecked.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

import torch
from torch import Tensor, nn

import lightning_kl as lk
import lightning_kl.ground.checks as ground_checks
from lightning_kl.estimators import SAMPLED_ESTIMATORS
from lightning_kl.functional import AGG_MODES


def seeded(device: torch.device, seed: int) -> torch.Generator:
    """A generator on ``device``: the same seed gives every variant of a case the same inputs."""
    return torch.Generator(device=device).manual_seed(seed)


def sampled_inputs(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Sampled log-probs ``[b, t]`` (requiring grad), reference log-probs near them and a mask, seeded."""
    g = seeded(device, 0)
    logprob = (-torch.rand(shape, generator=g, device=device) * 3).to(dtype).requires_grad_()
    ref = (logprob.detach().float() + 0.3 * torch.randn(shape, generator=g, device=device)).clamp(max=0).to(dtype)  # log-probs: <= 0
    mask = torch.rand(shape, generator=g, device=device) < 0.9
    return logprob, ref, mask


@dataclass
class SyncCall:
    name: str
    covers: tuple[str, ...]  # the public names it exercises
    make: Callable[[torch.device], Callable[[], Any]]  # builds the inputs; returns the call to check
    syncs: Optional[str] = None  # why it is expected to synchronize today; None: it should not
    guards_itself: bool = False  # the call wraps its own checked region (a Trainer around a hook)
    kind: str = "read"  # of the expected sync: "read" (the package reads a value on the host where it
    # allows itself to, see package_reads), "copy" (a copy to the device: only CUDA sees it), "design"


def package_reads(device: torch.device) -> bool:
    """Whether the package reads tensor values on the host per call on ``device``, as checked here.

    Where the package has a switch for it (``HOST_READ_DEVICES`` in ``lightning_kl.ground.checks``:
    the device types on which it allows itself host reads), the switch says, except on CPU, where
    the check runs the device form (:func:`sync_debug`). Without one it reads wherever it reads.
    """
    devices = getattr(ground_checks, "HOST_READ_DEVICES", None)
    if devices is None:
        return True
    return device.type != "cpu" and device.type in devices


#: On CPU, the ways Python code reads a tensor's value on the host: each one is a sync on CUDA.
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero", "cpu", "numpy")


@contextlib.contextmanager
def sync_debug(device: torch.device) -> Iterator[None]:
    """Make a host synchronization raise (a ``RuntimeError`` that says so), restored after.

    On CUDA: ``torch.cuda.set_sync_debug_mode("error")``, which sees every synchronization. On CPU,
    where nothing waits, an approximation: the Python-level host reads of :data:`HOST_READS` raise
    (not a read inside a torch op, such as boolean-mask indexing, nor a copy to the device). Where
    the package keeps host reads for the CPU only (a ``HOST_READ_DEVICES`` set in
    ``lightning_kl.ground.checks``), it is emptied meanwhile, so that the CPU runs the device form.
    """
    if device.type == "cuda":
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(before)
        return
    # only what Tensor defines itself is put back; the rest is deleted again, so that the inherited C
    # slots come back (a restored Python __index__ on Tensor changes how torch.tensor() reads lists)
    saved = {name: Tensor.__dict__[name] for name in HOST_READS if name in Tensor.__dict__}
    saved_nonzero = torch.nonzero
    saved_devices = getattr(ground_checks, "HOST_READ_DEVICES", None)

    def refuse(name: str) -> Callable[..., Any]:
        def read(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{name}: a host read of a tensor's value (synchronizing on CUDA)")

        return read

    try:
        for name in HOST_READS:
            setattr(Tensor, name, refuse(f"Tensor.{name}"))
        torch.nonzero = refuse("torch.nonzero")
        if saved_devices is not None:
            ground_checks.HOST_READ_DEVICES = frozenset()
        yield
    finally:
        for name in HOST_READS:
            if name in saved:
                setattr(Tensor, name, saved[name])
            else:
                delattr(Tensor, name)
        torch.nonzero = saved_nonzero
        if saved_devices is not None:
            ground_checks.HOST_READ_DEVICES = saved_devices


def _is_sync_error(e: BaseException) -> bool:
    return isinstance(e, RuntimeError) and "synchroniz" in str(e)


def _sampled(device: torch.device, name: str, **kwargs: Any) -> Callable[[], Any]:
    logprob, ref, mask = sampled_inputs((4, 16), torch.float32, device)
    old = (logprob.detach() - 0.1).contiguous() if kwargs.pop("old", False) else None

    def call() -> None:
        value = lk.kl_penalty(logprob, ref, name, mask=mask, old_logprob=old, **kwargs)
        lk.aggregate(value, mask, mode="seq-mean-token-sum").backward()

    return call


def _aggregate(device: torch.device, mode: str, masked: bool) -> Callable[[], Any]:
    logprob, _, mask = sampled_inputs((4, 16), torch.float32, device)
    m = mask if masked else None
    return lambda: lk.aggregate(logprob, m, mode=mode).backward()


def _logprobs_call(device: torch.device, ignore: bool) -> Callable[[], Any]:
    z = torch.randn(4, 8, 50, device=device, requires_grad=True)
    y = torch.randint(0, 50, (4, 8), device=device)
    if ignore:
        y[:, -2:] = -100
    return lambda: lk.token_logprobs(z, y, ignore_index=-100 if ignore else None).sum().backward()


def _hidden_call(device: torch.device) -> Callable[[], Any]:
    h = torch.randn(4, 8, 16, device=device, requires_grad=True)
    w = torch.randn(50, 16, device=device, requires_grad=True)
    y = torch.randint(0, 50, (4, 8), device=device)
    return lambda: lk.token_logprobs(lk.FromHidden(h, w), y).sum().backward()


def _full_call(device: torch.device, masked: bool) -> Callable[[], Any]:
    z = torch.randn(4, 8, 50, device=device, requires_grad=True)
    ref = torch.randn(4, 8, 50, device=device)
    mask = (torch.arange(8, device=device) < 6).expand(4, 8) if masked else None
    return lambda: lk.full_kl(z, ref, mask).sum().backward()


def _full_hidden_call(device: torch.device) -> Callable[[], Any]:
    h = torch.randn(4, 8, 16, device=device, requires_grad=True)
    w = torch.randn(50, 16, device=device, requires_grad=True)
    rh, rw = torch.randn(4, 8, 16, device=device), torch.randn(50, 16, device=device)
    return lambda: lk.full_kl(lk.FromHidden(h, w), lk.FromHidden(rh, rw)).sum().backward()


def _processed_call(device: torch.device, which: str) -> Callable[[], Any]:
    z = torch.randn(4, 8, 50, device=device, requires_grad=True)
    ref = torch.randn(4, 8, 50, device=device)
    proc = lk.Sampling(temperature=0.9, top_k=20, top_p=0.9)
    mask = torch.arange(8, device=device) < torch.tensor([[8], [5], [1], [0]], device=device)
    if which == "full":
        return lambda: lk.full_kl(z, ref, mask, sampling=proc).sum().backward()
    if which == "entropy":
        return lambda: lk.token_entropy(z, mask, sampling=proc).sum().backward()
    # tokens drawn inside every row's kept set: the most likely token is always kept
    y = z.detach().argmax(-1)
    if which == "hidden":
        h = torch.randn(4, 8, 16, device=device, requires_grad=True)
        w = torch.randn(50, 16, device=device, requires_grad=True)
        y = (h.detach() @ w.detach().T).argmax(-1)
        return lambda: lk.token_logprobs(lk.FromHidden(h, w), y, sampling=proc).sum().backward()
    if which == "both":  # the log-probs and the entropy in one pass, both in the loss
        return lambda: sum(t.sum() for t in lk.token_logprobs_and_entropy(z, y, sampling=proc)).backward()
    return lambda: lk.token_logprobs(z, y, sampling=proc, return_log_kept=True)[0].sum().backward()


def _loss_call(device: torch.device, estimator: str, from_hidden: bool = False) -> Callable[[], Any]:
    loss_fn = lk.KLPenaltyLoss(estimator, coef=0.1, level="sequence" if from_hidden else "token",
                               agg="seq-mean-token-sum" if from_hidden else "token-mean").to(device)
    logprob, ref, mask = sampled_inputs((4, 8), torch.float32, device)
    if from_hidden:
        h = torch.randn(4, 8, 16, device=device, requires_grad=True)
        w = torch.randn(50, 16, device=device, requires_grad=True)
        rh, rw = torch.randn(4, 8, 16, device=device), torch.randn(50, 16, device=device)
        y = torch.randint(0, 50, (4, 8), device=device)

        def call() -> None:
            sampled = lk.token_logprobs(lk.FromHidden(h, w), y)
            loss_fn(lk.FromHidden(h, w), lk.FromHidden(rh, rw), mask, sampled_logprob=sampled).backward()

        return call
    totals = lk.step_totals([mask, mask])
    return lambda: loss_fn(logprob, ref, mask, num_tokens=totals["num_tokens"], num_seqs=totals["num_seqs"], accumulate_grad_batches=2).backward()


def _mismatch_call(device: torch.device, which: str) -> Callable[[], Any]:
    """The rollout/trainer mismatch: ``mismatch_metrics``, ``MismatchMetric``, ``RolloutCorrection``."""
    logprob, rollout, mask = sampled_inputs((4, 8), torch.float32, device)
    logprob = logprob.detach()
    if which == "metrics":
        return lambda: lk.mismatch_metrics(logprob, rollout, mask)
    if which == "metric":
        metric = lk.MismatchMetric().to(device)
        return lambda: (metric.update(logprob, rollout, mask), metric.compute())
    fix = lk.RolloutCorrection("token", mode="mask", lower=0.5, upper=2.0, batch_normalize=True, rejection="token_k1,seq_max_k3",
                               rejection_threshold="0.5_2.0,0.2", offpolicy_mask_threshold=0.0)  # fmt: skip
    advantages = torch.randn(4, device=device)
    return lambda: fix(logprob, rollout, mask, advantages=advantages)


def _metric_call(device: torch.device, masked: bool) -> Callable[[], Any]:
    metric = lk.KLMetric().to(device)
    values, _, mask = sampled_inputs((4, 8), torch.float32, device)

    def call() -> None:
        metric.update(values.detach(), mask if masked else None)
        metric.compute()

    return call


def _controller_call(device: torch.device, adaptive: bool) -> Callable[[], Any]:
    c = lk.AdaptiveKLController(0.1, 6.0, 100) if adaptive else lk.FixedKLController(0.1)
    kl, n = torch.tensor(0.5, dtype=torch.float64, device=device), torch.tensor(8.0, dtype=torch.float64, device=device)
    c.value_tensor(device)

    def call() -> None:
        c.update(kl, n)
        c.value_tensor(device)

    return call


def _new_controller_call(device: torch.device, kind: str) -> Callable[[], Any]:
    target = lk.TargetKLController(target_kl=1.0, init_kl_coef=0.1, step_size=0.2)
    c = target if kind == "target" else lk.KLSchedule(target, kind="cosine", warmup_steps=2, total_steps=10)
    kl, n = torch.tensor(0.5, dtype=torch.float64, device=device), torch.tensor(8.0, dtype=torch.float64, device=device)
    c.value_tensor(device)

    def call() -> None:
        c.update(kl, n)
        c.value_tensor(device)

    return call


def _controlled_loss_call(device: torch.device) -> Callable[[], Any]:
    """A controller-driven ``KLPenaltyLoss``: two micro-batches' forward and backward, then ``update_coef``."""
    loss_fn = lk.KLPenaltyLoss("k3+", coef=lk.TargetKLController(target_kl=0.5, init_kl_coef=0.1), agg="seq-mean-token-sum").to(device)
    logprob, ref, mask = sampled_inputs((4, 8), torch.float32, device)
    loss_fn.update_coef(device=device)  # the coefficient on the device before the check

    def call() -> None:
        for _ in range(2):
            loss_fn(logprob, ref, mask).backward()
        loss_fn.update_coef()

    return call


def _entropy_call(device: torch.device, kind: str) -> Callable[[], Any]:
    """The entropy parts: a controlled ``EntropyBonus`` (two forward+backward, ``update_coef``), a
    ``TargetEntropyController`` update under each rule, or ``high_entropy_mask`` on one process."""
    g = seeded(device, 0)
    z = torch.randn(4, 8, 50, generator=g, device=device, requires_grad=True)
    mask = torch.rand(4, 8, generator=g, device=device) < 0.9
    if kind == "mask":
        entropy = lk.token_entropy(z.detach(), mask)
        return lambda: lk.high_entropy_mask(entropy, mask, top=0.2)
    if kind in ("dual", "additive"):
        c = lk.TargetEntropyController(target_entropy=2.0, init_coef=0.01, rule=kind)
        h, n = torch.tensor(1.5, dtype=torch.float64, device=device), torch.tensor(8.0, dtype=torch.float64, device=device)
        c.value_tensor(device)

        def update() -> None:
            c.update(h, n)
            c.value_tensor(device)

        return update
    bonus = lk.EntropyBonus(coef=lk.TargetEntropyController(target_entropy=2.0, init_coef=0.01)).to(device)
    bonus.update_coef(device=device)  # the coefficient on the device before the check

    def call() -> None:
        for _ in range(2):
            bonus(z, mask).backward()
        bonus.update_coef()

    return call


def _controller_read(device: torch.device) -> Callable[[], Any]:
    c = lk.AdaptiveKLController(0.1, 6.0, 100)
    c.update(torch.tensor(0.5, dtype=torch.float64, device=device), torch.tensor(8.0, dtype=torch.float64, device=device))
    return lambda: c.value


def _rollout(device: torch.device, per_sequence: bool) -> dict[str, Tensor]:
    logprobs, ref, mask = sampled_inputs((4, 8), torch.float32, device)
    mask[:, 0] = True
    scores = torch.randn(4, device=device) if per_sequence else torch.randn(4, 8, device=device)
    return {"scores": scores, "logprobs": logprobs.detach(), "ref_logprobs": ref, "mask": mask}


def _shape_rewards_call(device: torch.device) -> Callable[[], Any]:
    cb = lk.KLRewardCallback("k3", lk.AdaptiveKLController(0.1, 6.0, 100))
    batch = _rollout(device, per_sequence=True)

    def call() -> None:
        _, kl_sum, n = cb.shape_rewards(batch)
        cb.update_controller(kl_sum, n)

    return call


def _callback_call(device: torch.device) -> Callable[[], Any]:
    """``KLRewardCallback.on_train_batch_start`` checked inside a real Trainer on ``device``."""
    import lightning.pytorch as pl

    outcome: dict[str, Any] = {}

    class Checked(lk.KLRewardCallback):
        def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
            try:
                with sync_debug(device):
                    super().on_train_batch_start(*args, **kwargs)
            except Exception as e:  # recorded, raised after fit: a Trainer would wrap it
                outcome.setdefault("error", e)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(()))

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader([_rollout(torch.device("cpu"), False) for _ in range(2)], batch_size=None)

        def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
            outcome["rewards"] = "rewards" in batch
            return (self.w * batch["logprobs"].sum()) ** 2

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    def call() -> None:
        trainer = pl.Trainer(
            accelerator="cuda" if device.type == "cuda" else "cpu", devices=1, max_steps=2, logger=False,
            enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
            default_root_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "lightning_kl_gpu_bench"),
            callbacks=[Checked("k1", lk.AdaptiveKLController(0.1, 6.0, 100))],
        )
        trainer.fit(Module())
        if "error" in outcome:
            raise outcome["error"]
        if not outcome.get("rewards"):
            raise AssertionError("the callback's hook did not write `rewards` into the batch")

    return call


def _refresh_call(device: torch.device, alpha: float) -> Callable[[], Any]:
    """``ReferenceRefresh.refresh``: the reference mixed toward the policy in place (EMA or hard reset)."""
    module = nn.Module()
    module.policy = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)).to(device)
    module.ref = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)).to(device)
    refresh = lk.ReferenceRefresh(every_n_steps=1, alpha=alpha)
    return lambda: refresh.refresh(module)


class _TinyLM(nn.Module):
    """A causal-LM stand-in with a ``peft``-like adapter switch (for ``lk.hf``)."""

    peft_config: dict[str, Any] = {}

    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, logits_to_keep: int = 0, use_cache: bool = False) -> Any:
        logits = self.head(self.emb(input_ids))
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)

    @contextlib.contextmanager
    def disable_adapter(self) -> Iterator[None]:
        yield


def _hf_call(device: torch.device, which: str) -> Callable[[], Any]:
    model = _TinyLM().to(device)
    prompt_am = torch.ones(2, 3, dtype=torch.long, device=device)
    responses = torch.randint(3, 50, (2, 5), device=device)
    sequences = torch.cat([torch.randint(3, 50, (2, 3), device=device), responses], dim=1)
    mask = torch.ones(2, 5, dtype=torch.bool, device=device)
    if which == "response_mask":
        return lambda: lk.hf.response_mask(responses, 2)
    if which == "sequence_inputs":
        return lambda: lk.hf.sequence_inputs(prompt_am, mask)
    if which == "response_logits":
        logits = torch.randn(2, 8, 50, device=device)
        return lambda: lk.hf.response_logits(logits, 3)
    am, _ = lk.hf.sequence_inputs(prompt_am, mask)
    if which == "response_logprobs":
        return lambda: lk.hf.response_logprobs(model, sequences, am, 3).sum().backward()
    return lambda: lk.hf.reference_logprobs(model, sequences, am, 3)


def _capped_call(device: torch.device) -> Callable[[], Any]:
    """A Gemma-style head (soft cap) read from a config by lk.hf.from_hidden: the cap and its chain rule on the device."""
    head = nn.Linear(32, 50).to(device)
    model = SimpleNamespace(config=SimpleNamespace(model_type="gemma2", final_logit_softcapping=2.0), get_output_embeddings=lambda: head)
    h = torch.randn(16, 32, device=device, requires_grad=True)
    y = torch.randint(0, 50, (16,), device=device)
    return lambda: lk.token_logprobs(lk.hf.from_hidden(model, h), y).sum().backward()


def _topk_call(device: torch.device, divergence: str) -> Callable[[], Any]:
    """A served teacher's top-k (k = 5 of 50, one padded entry) against the student's logits, with the tails."""
    z = torch.randn(4, 8, 50, device=device, requires_grad=True)
    teacher = torch.randn(4, 8, 50, device=device).log_softmax(-1)
    lp, ids = teacher.topk(5, dim=-1)
    lp[..., -1] = float("-inf")  # a shorter list: padding
    mask = (torch.arange(8, device=device) < 6).expand(4, 8)
    topk = lk.TopK(ids, lp)

    def call() -> None:
        out = lk.full_kl(z, topk, mask, divergence=divergence, return_tails=True)
        out.value.sum().backward()

    return call


_IDS = "the id range check reads the ids' min and max on the host (inputs.py: check_tokens)"
_H2D = "copies a Python number or list to the device (torch.tensor / torch.as_tensor on CUDA waits for the copy)"

#: Every call checked under sync-debug: (name, public names covered, inputs, why it syncs today).
SYNC_CALLS: list[SyncCall] = [
    *(SyncCall(f"kl_penalty {n} (mask, seq-mean-token-sum, backward)", ("kl_penalty", "aggregate", "EstimatorName"), lambda d, n=n: _sampled(d, n))
      for n in SAMPLED_ESTIMATORS),
    SyncCall("kl_penalty k3+ old_logprob max_weight=2", ("kl_penalty",), lambda d: _sampled(d, "k3+", old=True, max_weight=2.0)),
    SyncCall("kl_penalty k3+ level=sequence", ("kl_penalty", "Level"), lambda d: _sampled(d, "k3+", level="sequence")),
    SyncCall("kl_penalty k2 level=sequence old_logprob kl_to_go=k3", ("kl_penalty",), lambda d: _sampled(d, "k2", level="sequence", old=True, kl_to_go="k3")),
    *(SyncCall(f"aggregate {m} (mask)", ("aggregate", "AggMode"), lambda d, m=m: _aggregate(d, m, True)) for m in AGG_MODES),
    SyncCall("aggregate token-mean (no mask)", ("aggregate",), lambda d: _aggregate(d, "token-mean", False), syncs=_H2D + ": the token count", kind="copy"),
    SyncCall("step_totals", ("step_totals",), lambda d: (lambda m=sampled_inputs((4, 8), torch.float32, d)[2]: lk.step_totals([m, m[:, :4]]))),
    SyncCall("token_logprobs", ("token_logprobs",), lambda d: _logprobs_call(d, False), syncs=_IDS),
    SyncCall("token_logprobs ignore_index=-100", ("token_logprobs",), lambda d: _logprobs_call(d, True), syncs=_IDS),
    SyncCall("token_logprobs FromHidden", ("token_logprobs", "FromHidden"), _hidden_call, syncs=_IDS),
    SyncCall("token_logprobs sampling=Sampling(0.9, top_k=20, top_p=0.9)", ("token_logprobs", "Sampling"), lambda d: _processed_call(d, "logits")),
    SyncCall("token_logprobs FromHidden sampling=", ("token_logprobs", "FromHidden"), lambda d: _processed_call(d, "hidden")),
    SyncCall("full_kl sampling=", ("full_kl",), lambda d: _processed_call(d, "full")),
    SyncCall("token_entropy sampling= (mask)", ("token_entropy",), lambda d: _processed_call(d, "entropy")),
    SyncCall("token_logprobs_and_entropy sampling=", ("token_logprobs_and_entropy",), lambda d: _processed_call(d, "both")),
    SyncCall("full_kl (mask)", ("full_kl",), lambda d: _full_call(d, True)),
    SyncCall("full_kl (no mask)", ("full_kl",), lambda d: _full_call(d, False)),
    SyncCall("full_kl FromHidden", ("full_kl", "FromHidden"), _full_hidden_call),
    SyncCall("kl_penalty full", ("kl_penalty",), lambda d: (lambda z=torch.randn(2, 4, 50, device=d, requires_grad=True): lk.kl_penalty(z, z.detach() + 1, "full").sum().backward())),
    SyncCall("KLPenaltyLoss k3+ (step_totals, accumulate_grad_batches=2)", ("KLPenaltyLoss", "step_totals", "KLMetric"), lambda d: _loss_call(d, "k3+")),
    SyncCall("KLPenaltyLoss full FromHidden level=sequence", ("KLPenaltyLoss", "FromHidden"), lambda d: _loss_call(d, "full", from_hidden=True), syncs=_IDS),
    SyncCall("KLMetric update+compute (mask)", ("KLMetric",), lambda d: _metric_call(d, True)),
    SyncCall("KLMetric update+compute (no mask)", ("KLMetric",), lambda d: _metric_call(d, False), syncs=_H2D + ": the token count (metric.py)", kind="copy"),
    SyncCall("mismatch_metrics (mask)", ("mismatch_metrics",), lambda d: _mismatch_call(d, "metrics")),
    SyncCall("MismatchMetric update+compute (mask)", ("MismatchMetric",), lambda d: _mismatch_call(d, "metric")),
    SyncCall("RolloutCorrection token mask, batch_normalize, rejection, off-policy mask", ("RolloutCorrection",), lambda d: _mismatch_call(d, "correction")),
    SyncCall("FixedKLController.update(tensors)", ("FixedKLController", "KLController"), lambda d: _controller_call(d, False)),
    SyncCall("AdaptiveKLController.update(tensors)", ("AdaptiveKLController", "KLController"), lambda d: _controller_call(d, True)),
    SyncCall("TargetKLController.update(tensors)", ("TargetKLController", "KLController"), lambda d: _new_controller_call(d, "target")),
    SyncCall("KLSchedule(TargetKLController).update(tensors)", ("KLSchedule", "TargetKLController"), lambda d: _new_controller_call(d, "schedule")),
    SyncCall("KLPenaltyLoss(coef=TargetKLController): 2 x forward+backward, update_coef", ("KLPenaltyLoss", "TargetKLController"), _controlled_loss_call),
    SyncCall("KLController.value (a float: reads the device by design)", ("KLController",), _controller_read, syncs="a Python float of a device tensor, by design (checkpoints, every log_every_n_steps)", kind="design"),
    SyncCall("KLRewardCallback.shape_rewards + update_controller (per-sequence scores)", ("KLRewardCallback",), _shape_rewards_call),
    SyncCall("KLRewardCallback.on_train_batch_start in a Trainer", ("KLRewardCallback",), _callback_call, guards_itself=True),
    SyncCall("ReferenceRefresh.refresh (EMA, alpha=0.5)", ("ReferenceRefresh",), lambda d: _refresh_call(d, 0.5)),
    SyncCall("ReferenceRefresh.refresh (hard reset)", ("ReferenceRefresh",), lambda d: _refresh_call(d, 1.0)),
    SyncCall("hf.response_mask", ("hf.response_mask",), lambda d: _hf_call(d, "response_mask"), syncs=_H2D + ": the EOS ids (hf.py: _eos_hits)", kind="copy"),
    SyncCall("hf.sequence_inputs", ("hf.sequence_inputs",), lambda d: _hf_call(d, "sequence_inputs")),
    SyncCall("hf.response_logits", ("hf.response_logits",), lambda d: _hf_call(d, "response_logits")),
    SyncCall("hf.response_logprobs (tiny LM, backward)", ("hf.response_logprobs",), lambda d: _hf_call(d, "response_logprobs"), syncs=_IDS + " (through token_logprobs)"),
    SyncCall("hf.reference_logprobs (adapters off)", ("hf.reference_logprobs", "hf.adapters_disabled"), lambda d: _hf_call(d, "reference_logprobs"), syncs=_IDS + " (through token_logprobs)"),
    SyncCall("EntropyBonus(coef=TargetEntropyController): 2 x forward+backward, update_coef", ("EntropyBonus", "TargetEntropyController"), lambda d: _entropy_call(d, "bonus")),
    *(SyncCall(f"TargetEntropyController(rule={r!r}).update(tensors)", ("TargetEntropyController",), lambda d, r=r: _entropy_call(d, r)) for r in ("dual", "additive")),
    SyncCall("high_entropy_mask (one process, mask)", ("high_entropy_mask",), lambda d: _entropy_call(d, "mask")),
    *(SyncCall(f"full_kl TopK divergence={v!r} return_tails (mask, backward)", ("full_kl", "TopK"), lambda d, v=v: _topk_call(d, v)) for v in ("reverse", "forward")),
    SyncCall("hf.from_hidden (soft cap, backward)", ("hf.from_hidden",), _capped_call, syncs=_IDS + " (through token_logprobs)"),
]

#: Public names with no device work to check, and why.
HOST_ONLY: dict[str, str] = {
    "Sampling": "a validated sampler configuration (host data)",
    "OnPolicyRollouts": "an iterable that calls the user's sampler; no tensor work of its own",
    "hf": "the module; its functions are listed one by one",
    "KLLossCallback": "a callback: attaches the losses at setup; its per-step work is KLPenaltyLoss.update_coef (with the controllers)",
    "hf.sampler_agreement": "an opt-in check that returns its figures as Python floats: one host read per call, "
    "by design (also behind hf.response_logprobs(sampler_scores=), which is off by default)",
    "hf.SamplerAgreement": "a tuple of Python numbers (host data)",
    "hf.SamplerMismatchWarning": "a warning class",
    "hf.RATIO_BAND": "a constant: the band of PPO ratios the checks and the example report (host data)",
    "hf.logit_transform": "reads a model's config: Python numbers (host data)",
    "VocabShard": "needs a tensor parallel process group; its device form without host reads is "
    "checked on CPU by tests/test_vocab_parallel.py",
}


def coverage() -> dict[str, list[str]]:
    """Public names that no call covers (``missing``) and names listed that are not public (``stale``)."""
    public = set(lk.__all__) | {f"hf.{n}" for n in lk.hf.__all__}
    listed = {n for c in SYNC_CALLS for n in c.covers} | set(HOST_ONLY)
    return {"missing": sorted(public - listed), "stale": sorted(listed - public)}


def check_sync(call: SyncCall, device: torch.device, row: dict[str, Any]) -> None:
    """Run ``call`` under :func:`sync_debug`; fill ``row`` with its status (and where it synchronized).

    Statuses on CUDA: ``no sync``, ``sync (expected)``, ``SYNC (unexpected)``, ``no sync (marked as
    expected: update the mark)``. On CPU the same with "host read" for "sync", and ``no host read
    (a copy to the device: CUDA only)`` for an expected sync that the CPU check cannot see.
    """
    cuda = device.type == "cuda"
    synced = False
    try:
        fn = call.make(device)
        if cuda:
            torch.cuda.synchronize(device)  # the inputs' work is not the call's
        if call.guards_itself:
            fn()
        else:
            with sync_debug(device):
                fn()
        if cuda:
            torch.cuda.synchronize(device)
    except Exception as e:
        if not _is_sync_error(e):
            row.update(status="ERROR", reason=f"{type(e).__name__}: {e}"[:300], traceback=traceback.format_exc(limit=6))
            return
        synced = True
        row["where"] = "".join(traceback.format_exception_only(type(e), e)).strip()[:300]
        row["traceback"] = traceback.format_exc(limit=8)
    word = "sync" if cuda else "host read"
    expected = call.syncs is not None and (call.kind != "read" or package_reads(device))
    row["expected"] = call.syncs if expected else None
    if synced:
        status = f"{word} (expected)" if expected else f"{word.upper()} (unexpected)"
    elif expected and call.kind == "copy" and not cuda:
        status = "no host read (a copy to the device: CUDA only)"
    else:
        status = f"no {word} (marked as expected: update the mark)" if expected else f"no {word}"
    row["status"] = status


