"""A Lightning loop under ``ModelParallelStrategy`` on CPU (gloo), or the same loop in one process.

``python tests/_mp_worker.py OUT_DIR LAYOUT`` runs ``Trainer(accelerator="cpu", devices=W,
strategy=ModelParallelStrategy(data_parallel_size=DP, tensor_parallel_size=TP))`` with LAYOUT one of

* ``fsdp2``: 2 processes, FSDP2 data parallel (DP 2 x TP 1); the policy is a tiny Qwen2 with LoRA
  adapters (and a trainable LM head wrapped by FSDP2 on its own); the reference is the same model
  with the adapters off;
* ``dp_tp``: 4 processes, data parallel x tensor parallel (DP 2 x TP 2); the policy and a separate
  frozen reference are tiny Qwen2 models, tensor parallel (attention, MLP, and a column-parallel LM
  head) and FSDP2-sharded over the data parallel dimension;

and each rank writes ``OUT_DIR/rank{r}.json``. ``tests/test_model_parallel.py`` launches it through
``tests/_ddp.py`` and runs :func:`fit` with ``devices=1`` over the global batch in its own process.

Every step is one configuration of :data:`CONFIGS` (an estimator, an ``agg`` mode, a level,
off-policy weights, step totals, the ``full`` estimator from logits or from hidden states) with
``lr=0``, so that every step sees the same weights; the record holds each step's loss and the
gradients of the policy's trainable parameters after FSDP's reduction (made whole), the
``KLRewardCallback`` coefficient and rewards, and the synced metrics. The global batch has 6
sequences; data parallel replica ``r`` of 2 holds rows ``3r .. 3r + 2`` (9 and 6 valid tokens, 3 and 2
non-empty sequences), and the tensor parallel ranks of a replica hold the same rows.
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

import lightning_kl as lk
from lightning_kl.functional import AGG_MODES
from _vocab import logprobs_from_hidden
from _ddp import write_rank_record
from _trainers import make_quiet_trainer

LAYOUTS = {"fsdp2": (2, 1), "dp_tp": (2, 2)}  # (data parallel, tensor parallel)
VOCAB, HIDDEN, HEADS, INTER = 13, 16, 2, 32
GLOBAL_B, P, T = 6, 3, 5  # sequences, prompt length, response length
LENGTHS = (5, 3, 1, 0, 4, 2)  # valid response tokens per row: replica 0 holds 9 in 3 rows, replica 1 6 in 2
CONTROLLER = {"init_kl_coef": 0.2, "target_kl": 0.3, "horizon": 10}
COEF = 0.5

# one configuration a step: (estimator, agg, level, what else)
#   "on": on-policy; "off": old_logprob (importance weights); "cap": old_logprob and max_weight=1.5;
#   "totals": the batch split into two halves, each given the step's totals (lk.step_totals);
#   "hidden": the policy's log-probs (or 'full': both models' logits) from the hidden states and the LM head;
#   "jsd", "hidden-jsd": 'full' with divergence="jsd" (from the logits, from the hidden states and the LM head)
CONFIGS: list[tuple[str, str, str, str]] = (
    [("k3+", agg, "token", "on") for agg in AGG_MODES]
    + [("k2", agg, "sequence", "off") for agg in AGG_MODES if agg != "seq-mean-token-mean"]
    + [
        ("k1", "token-sum", "token", "cap"),
        ("k3+", "token-mean", "token", "totals"),
        ("k3+", "seq-mean-token-mean", "token", "totals"),
        ("full", "token-sum", "token", "on"),
        ("full", "seq-mean-token-sum", "sequence", "on"),
        # another divergence (a teacher's), the JSD: under dp_tp on the vocabulary-sharded logits, its second
        # read of each shard (the forward KL and the mix on shards: tests/_divergence_parallel_worker.py)
        ("full", "token-sum", "token", "jsd"),
    ]
)
HIDDEN_CONFIGS = [
    ("k3+", "token-sum", "token", "hidden"),
    ("full", "seq-mean-token-sum-norm", "token", "hidden"),
    ("full", "token-mean", "token", "hidden-jsd"),  # the JSD's second read of the FSDP2 head's tiles
]
# what the docs say never to do, recorded to show why: the sharded head made whole with full_tensor()
FULL_TENSOR_CONFIG = ("k3+", "token-sum", "token", "full_tensor")


def configs(layout: str) -> list[tuple[str, str, str, str]]:
    # from hidden states: the FSDP2-sharded head (fsdp2); under dp_tp the head is tensor parallel,
    # which the vocabulary-parallel kernels take (TODO(vocab-parallel): add HIDDEN_CONFIGS there)
    return CONFIGS + (HIDDEN_CONFIGS + [FULL_TENSOR_CONFIG] if layout == "fsdp2" else [])


def config_key(config: tuple[str, str, str, str]) -> str:
    return "|".join(config)


def data(n_steps: int) -> list[dict[str, Tensor]]:
    """The global batches: token ids, the response mask, the rollout fields the callback reads."""
    g = torch.Generator().manual_seed(17)
    mask = torch.arange(T).expand(GLOBAL_B, T) < torch.tensor(LENGTHS).unsqueeze(-1)
    out = []
    for step in range(n_steps):
        logprobs = -torch.rand(GLOBAL_B, T, generator=g, dtype=torch.float64) * 3
        d = 0.3 + 0.1 * step % 3 + 0.2 * torch.randn(GLOBAL_B, T, generator=g, dtype=torch.float64)
        d[GLOBAL_B // 2 :] += 0.3  # replica 1 drifted further
        out.append(
            {
                "input_ids": torch.randint(3, VOCAB, (GLOBAL_B, P + T), generator=g),
                "mask": mask.clone(),
                "old_shift": 0.3 * torch.randn(GLOBAL_B, T, generator=g, dtype=torch.float64),
                "scores": torch.randn(GLOBAL_B, T, generator=g, dtype=torch.float64),
                "logprobs": torch.where(mask, logprobs, float("nan")),
                "ref_logprobs": torch.where(mask, logprobs - d, float("-inf")),
            }
        )
    return out


def build(seed: int) -> nn.Module:
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=P + T,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config).to(torch.float64)
        for p in model.parameters():  # weights large enough that the policy and its logits differ visibly
            p.data.normal_(0, 0.5)
    return model


def tensor_parallel(model: nn.Module, mesh: Any) -> None:
    """Attention heads and the MLP split over ``mesh``; the LM head column-parallel (over the vocabulary)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for layer in model.model.layers:
        plan = {name: ColwiseParallel() for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                     "mlp.gate_proj", "mlp.up_proj")}
        plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()})
        parallelize_module(layer, mesh, plan)
    # logits sharded over the vocabulary as a DTensor: lk.token_logprobs and "full" take them as they are
    parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})


class MPProbe(pl.LightningModule):
    def __init__(self, layout: str) -> None:
        super().__init__()
        self.configs = configs(layout)
        self.lora = layout == "fsdp2"
        if self.lora:
            import peft

            base = build(0)
            lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(1)
                self.policy = peft.get_peft_model(base, lora)
            g = torch.Generator().manual_seed(2)
            for n, p in sorted(self.policy.named_parameters()):
                if "lora_B" in n:  # peft starts B at 0: the adapters would change nothing at all
                    p.data.normal_(0, 0.3, generator=g)
            # the head trains too: its gradient through an FSDP2-sharded head is checked
            self.policy.base_model.model.lm_head.weight.requires_grad_(True)
            self.ref = None
        else:
            self.policy = build(0)
            self.ref = build(1)
            self.ref.requires_grad_(False)
        self.losses = nn.ModuleList([self._loss(c) for c in self.configs])
        self.record: dict[str, Any] = {"losses": {}, "grads": {}, "rewards": [], "coef": [], "errors": {}}

    @staticmethod
    def _loss(config: tuple[str, str, str, str]) -> lk.KLPenaltyLoss:
        estimator, agg, level, extra = config
        max_weight = 1.5 if extra == "cap" else None
        divergence = "jsd" if extra in ("jsd", "hidden-jsd") else "reverse"
        return lk.KLPenaltyLoss(estimator, coef=COEF, agg=agg, level=level, global_batch=True, max_weight=max_weight, divergence=divergence)

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None:  # one process
            return
        from torch.distributed.fsdp import fully_shard

        models = [self.policy] + ([self.ref] if self.ref is not None else [])
        for model in models:
            inner = model.base_model.model if self.lora else model
            if mesh["tensor_parallel"].size() > 1:
                tensor_parallel(inner, mesh["tensor_parallel"])
            dp = mesh["data_parallel"]
            for layer in inner.model.layers:
                fully_shard(layer, mesh=dp)
            fully_shard(inner.lm_head, mesh=dp)  # on its own: resharded after forward, a Shard(0) DTensor
            fully_shard(model, mesh=dp)

    def _replica(self) -> tuple[int, int]:
        mesh = self.device_mesh
        if mesh is None:
            return 0, 1
        return mesh["data_parallel"].get_local_rank(), mesh["data_parallel"].size()

    def train_dataloader(self) -> Any:
        rank, size = self._replica()
        b = GLOBAL_B // size
        batches = [{k: v[rank * b : (rank + 1) * b].clone() for k, v in batch.items()} for batch in data(len(self.configs))]
        return torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)

    def _forward(self, model: nn.Module, ids: Tensor, hidden: bool) -> tuple[Tensor, Optional[Tensor]]:
        """Response logits ``[b, t, V]`` and, with ``hidden``, the last hidden states ``[b, t, d]``.

        Under tensor parallelism the logits stay a DTensor sharded over the vocabulary (``Shard(-1)``):
        the log-probs and the full KL are computed without gathering it (docs/scale.md).
        """
        out = model(input_ids=ids, use_cache=False, output_hidden_states=hidden)
        logits = out.logits
        if hasattr(logits, "placements"):
            self.record["vocab_sharded"] = [type(x).__name__ for x in logits.placements]
        h = out.hidden_states[-1][:, P - 1 : P + T - 1] if hidden else None
        return logits[:, P - 1 : P + T - 1], h

    def _head(self) -> nn.Module:
        return self.policy.base_model.model.lm_head if self.lora else self.policy.lm_head

    def _head_weight(self, key: str) -> Tensor:
        """The LM head's weight for ``FromHidden``: under FSDP2, unsharded through its FSDP module, the
        reshard left to FSDP after backward (passing the sharded DTensor is refused: recorded)."""
        head = self._head()
        weight = head.weight
        if hasattr(weight, "full_tensor"):
            try:
                logprobs_from_hidden(torch.zeros(1, HIDDEN, dtype=weight.dtype), weight, torch.zeros(1, dtype=torch.long))
            except TypeError as err:
                self.record["errors"][key] = str(err)
            head.unshard()
            weight = head.weight
        return weight

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        config = self.configs[batch_idx]
        estimator, agg, level, extra = config
        key = config_key(config)
        ids, mask = batch["input_ids"], batch["mask"]
        tokens = ids[:, P:]
        hidden = extra in ("hidden", "hidden-jsd", "full_tensor")
        logits, h = self._forward(self.policy, ids, hidden)
        with torch.no_grad():
            if self.lora:
                with lk.hf.adapters_disabled(self.policy):
                    ref_logits, ref_h = self._forward(self.policy, ids, hidden)
            else:
                ref_logits, ref_h = self._forward(self.ref, ids, hidden)
        loss_fn = self.losses[batch_idx]
        if extra == "full_tensor":
            weight = self._head().weight
            weight = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
            logprob = logprobs_from_hidden(h, weight, tokens)
            loss = loss_fn(logprob, logprobs_from_hidden(ref_h, weight.detach(), tokens), mask)
        elif hidden:
            weight = self._head_weight(key)
            if estimator == "full":
                loss = loss_fn(lk.FromHidden(h, weight), lk.FromHidden(ref_h, weight.detach()), mask)
            else:
                logprob = logprobs_from_hidden(h, weight, tokens)
                ref_logprob = logprobs_from_hidden(ref_h, weight.detach(), tokens)
                loss = loss_fn(logprob, ref_logprob, mask)
        elif estimator == "full":
            sampled = lk.token_logprobs(logits, tokens) if level == "sequence" else None
            loss = loss_fn(logits, ref_logits, mask, sampled_logprob=sampled)
        else:
            logprob = lk.token_logprobs(logits, tokens)
            ref_logprob = lk.token_logprobs(ref_logits, tokens)
            old = (logprob.detach() + batch["old_shift"]) if extra in ("off", "cap") else None
            if extra == "totals":
                halves = (slice(0, 1), slice(1, None))  # unequal micro-batches of this replica's rows
                totals = lk.step_totals([mask[s] for s in halves])
                loss = sum(loss_fn(logprob[s], ref_logprob[s], mask[s], **totals) for s in halves)
            else:
                loss = loss_fn(logprob, ref_logprob, mask, old_logprob=old)
        self.record["losses"][key] = loss.item()
        self.record["rewards"].append(batch["rewards"].tolist())
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        key = config_key(self.configs[self.global_step])
        grads = {}
        for name, p in self.policy.named_parameters():
            if p.requires_grad:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                g = g.full_tensor() if hasattr(g, "full_tensor") else g  # a collective: every rank, same order
                grads[name] = g.flatten().tolist()
        self.record["grads"][key] = grads

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        (callback,) = [c for c in self.trainer.callbacks if isinstance(c, lk.KLRewardCallback)]
        self.record["coef"].append(callback.controller.value)

    def on_train_end(self) -> None:
        # synced over the data parallel group by torchmetrics (every rank takes part)
        self.record["metrics"] = {config_key(c): float(f.metric.compute()) for c, f in zip(self.configs, self.losses)}
        counts = {}
        for c, f in zip(self.configs, self.losses):
            with f.metric.sync_context():  # the synced state: every replica's tokens once
                counts[config_key(c)] = int(f.metric.count)
        self.record["metric_counts"] = counts

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.policy.parameters() if p.requires_grad], lr=0.0)


def fit(root: str, layout: str, **trainer_kwargs: Any) -> dict[str, Any]:
    """Run :class:`MPProbe` of ``layout`` for one step per configuration; return this process's record.

    Without a ``strategy`` in ``trainer_kwargs`` (``devices=1``): the same models, unsharded, over the
    global batch."""
    warnings.filterwarnings("ignore")
    model = MPProbe(layout)
    callback = lk.KLRewardCallback("k1", controller=lk.AdaptiveKLController(**CONTROLLER))
    trainer = make_quiet_trainer(
        root, max_steps=len(model.configs), callbacks=[callback], use_distributed_sampler=False, **trainer_kwargs
    )
    start = time.perf_counter()
    trainer.fit(model)
    model.record.update(rank=trainer.global_rank, world_size=trainer.world_size, fit_seconds=time.perf_counter() - start)
    rank, size = model._replica()
    model.record.update(dp_rank=rank, dp_size=size)
    return model.record


def layout_errors() -> dict[str, str]:
    """After a DP x TP fit: what each explicit group gives (a given group wins over the mesh found), or the error."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_kl.ground.parallel import data_parallel_group

    world = torch.distributed.group.WORLD
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.zeros(2, 3, dtype=torch.float64)
    attempts = {
        "unnamed_2d_mesh": lambda: data_parallel_group(device_mesh=mesh).size,
        "world_given": lambda: data_parallel_group(process_group=world).size,
        "tp_given": lambda: data_parallel_group(device_mesh=mesh["tp"]).size,
        "found": lambda: data_parallel_group().size,  # the strategy's mesh's "data_parallel" dimension
        # token-sum with global_batch: multiplied by the group's size, so 4 x 0 stays 0; the size is what counts
        "loss_world": lambda: lk.KLPenaltyLoss("k1", agg="token-sum", global_batch=True, process_group=world)(x, x).item(),
        "dp_given_size": lambda: data_parallel_group(device_mesh=mesh["dp"]).size,
    }
    errors = {}
    for name, attempt in attempts.items():
        try:
            errors[name] = str(attempt())
        except ValueError as err:
            errors[name] = str(err)
    return errors


def main(out_dir: str, layout: str) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    torch.set_num_threads(1)
    dp, tp = LAYOUTS[layout]
    strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp)
    record = fit(out_dir, layout, devices=dp * tp, strategy=strategy)
    if tp > 1:
        record["layout_errors"] = layout_errors()
    write_rank_record(out_dir, record)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
