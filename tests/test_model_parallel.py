"""Lightning's ``ModelParallelStrategy`` on CPU (gloo) agrees with one process over the global batch.

Two launches of tests/_mp_worker.py (through tests/_ddp.py, each in a subprocess with a timeout):
FSDP2 data parallel on 2 processes (a tiny Qwen2 with LoRA; the reference is the model with its
adapters off; the LM head sharded on its own), and data parallel x tensor parallel (2 x 2) on 4
processes (policy and a separate reference, both tensor parallel and FSDP2-sharded). The two
replicas hold 9 and 6 valid tokens in 3 and 2 non-empty sequences; the tensor parallel ranks of a
replica hold the same rows, so a reduction over every process instead of the data parallel group
counts each batch twice (the `token-sum` loss and gradient doubled, the controller's ``n_steps``
doubled). The same module then runs here in one process over the global batch, in float64.

The data parallel group's rules that need no process group (arguments, strategies) are checked here
directly; those that need one (a mesh without a ``data_parallel`` dimension, a group that disagrees)
in the 4-process launch.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk
from _ddp import run_ddp_worker
from lightning_kl.ground.parallel import check_parallel_args, data_parallel_group

pytest.importorskip("transformers")
pytest.importorskip("peft")

WORKER_PATH = Path(__file__).with_name("_mp_worker.py")
_spec = importlib.util.spec_from_file_location("_mp_worker", WORKER_PATH)
assert _spec is not None and _spec.loader is not None
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

LAYOUTS = list(worker.LAYOUTS)


def _launch(tmp_path_factory: pytest.TempPathFactory, layout: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every rank's record of ``layout``, and the one-process record over the global batch."""
    dp, tp = worker.LAYOUTS[layout]
    ranks = run_ddp_worker(WORKER_PATH, tmp_path_factory.mktemp(layout), layout, world=dp * tp, timeout=300)
    single = worker.fit(str(tmp_path_factory.mktemp(f"{layout}_single")), layout, devices=1)
    return ranks, single


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    return _launch(tmp_path_factory, "fsdp2")


@pytest.fixture(scope="module")
def dp_tp(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    return _launch(tmp_path_factory, "dp_tp")


@pytest.fixture(params=LAYOUTS)
def run(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    return (request.param, *request.getfixturevalue(request.param))


def test_the_replicas_hold_unequal_data_and_the_tensor_parallel_ranks_the_same(dp_tp: Any) -> None:
    lengths = worker.LENGTHS
    assert sum(lengths[:3]) != sum(lengths[3:]) and sum(map(bool, lengths[:3])) != sum(map(bool, lengths[3:]))
    ranks, _ = dp_tp
    assert [(r["dp_rank"], r["dp_size"]) for r in ranks] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert ranks[0]["rewards"] == ranks[1]["rewards"] != ranks[2]["rewards"] == ranks[3]["rewards"]
    # the log-probs and the full KL were given the tensor parallel head's logits as they are: a DTensor
    # sharded over the vocabulary, never gathered (so the equalities below hold for that path)
    assert all(r["vocab_sharded"] == ["Shard"] for r in ranks)


def test_every_configuration_gives_the_one_process_loss_gradient_and_metric(run: Any) -> None:
    layout, ranks, single = run
    configs = [worker.config_key(c) for c in worker.configs(layout)]
    assert list(single["losses"]) == configs and all(list(r["losses"]) == configs for r in ranks)
    for key in configs:
        if key == worker.config_key(worker.FULL_TENSOR_CONFIG):
            continue  # the wrong recipe: see the test below
        # each replica's loss is dp times its share: their mean is the global batch's loss
        per_replica = {r["dp_rank"]: r["losses"][key] for r in ranks}
        assert_close(sum(per_replica.values()) / len(per_replica), single["losses"][key], rtol=1e-12, atol=1e-12, msg=key)
        for r in ranks:
            assert r["losses"][key] == per_replica[r["dp_rank"]], key  # tensor parallel ranks agree
            assert set(r["grads"][key]) == set(single["grads"][key])
            for name, grad in single["grads"][key].items():
                expected = torch.tensor(grad, dtype=torch.float64)
                assert expected.abs().sum() > 0, (key, name)
                got = torch.tensor(r["grads"][key][name], dtype=torch.float64)
                assert_close(got, expected, rtol=1e-12, atol=1e-12, msg=f"{key} {name} rank {r['rank']}")
            assert_close(r["metrics"][key], single["metrics"][key], rtol=1e-12, atol=1e-12, msg=key)
            assert r["metric_counts"][key] == single["metric_counts"][key] == sum(worker.LENGTHS), key


def reference_trajectory(n_steps: int) -> list[float]:
    """The AdaptiveKLController over the global batches, in float64 from the formula (k1, per-sequence means)."""
    cfg, value, out = worker.CONTROLLER, worker.CONTROLLER["init_kl_coef"], []
    for batch in worker.data(n_steps):
        seq_kls = []
        for lp, ref, m in zip(batch["logprobs"].tolist(), batch["ref_logprobs"].tolist(), batch["mask"].tolist()):
            ds = [a - b for a, b, keep in zip(lp, ref, m) if keep]
            if ds:
                seq_kls.append(sum(ds) / len(ds))
        err = min(max(sum(seq_kls) / len(seq_kls) / cfg["target_kl"] - 1, -0.2), 0.2)
        value *= 1 + err * len(seq_kls) / cfg["horizon"]
        out.append(value)
    return out


def test_callback_coefficient_is_the_one_process_one_to_rounding_and_rewards_match(run: Any) -> None:
    _, ranks, single = run
    assert_close(single["coef"], reference_trajectory(len(single["coef"])), rtol=1e-13, atol=0)
    rows = worker.GLOBAL_B // ranks[0]["dp_size"]
    for r in ranks:
        assert r["coef"] == ranks[0]["coef"]  # bitwise across ranks: one all-reduce gives every rank the same bits
        # against one process: the global KL sums the ranks' shares in another order (an ulp or so of the KL,
        # which moves the factor 1 + e n / horizon by far less); a few float64 roundings a step: rtol 1e-13
        assert_close(r["coef"], single["coef"], rtol=1e-13, atol=0)
        for got, full in zip(r["rewards"], single["rewards"]):
            expected = full[r["dp_rank"] * rows : (r["dp_rank"] + 1) * rows]
            assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-12, atol=1e-12)


def test_an_fsdp2_sharded_head_is_refused_with_the_recipe(fsdp2: Any) -> None:
    ranks, _ = fsdp2
    for r in ranks:
        assert set(r["errors"]) == {worker.config_key(c) for c in worker.HIDDEN_CONFIGS}
        for message in r["errors"].values():
            assert "Shard(dim=0)" in message and "unshard()" in message and "full_tensor()" in message


def test_full_tensor_on_an_fsdp2_head_gives_the_right_loss_and_a_wrong_head_gradient(fsdp2: Any) -> None:
    # why the docs and the error say never to do it: the gradient goes back to each rank's shard
    # from that rank's rows only, and FSDP never reduce-scatters it
    ranks, single = fsdp2
    key = worker.config_key(worker.FULL_TENSOR_CONFIG)
    assert_close(sum(r["losses"][key] for r in ranks) / 2, single["losses"][key], rtol=1e-12, atol=1e-12)
    head = "base_model.model.lm_head.weight"
    expected = torch.tensor(single["grads"][key][head], dtype=torch.float64)
    for r in ranks:
        got = torch.tensor(r["grads"][key][head], dtype=torch.float64)
        assert (got - expected).norm() > 0.1 * expected.norm()
        for name, grad in single["grads"][key].items():
            if name != head:  # the rest of the model is right
                assert_close(torch.tensor(r["grads"][key][name], dtype=torch.float64), torch.tensor(grad, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_a_group_given_wins_over_the_mesh_found_and_an_unnamed_2d_mesh_is_refused(dp_tp: Any) -> None:
    ranks, _ = dp_tp
    for r in ranks:
        errors = r["layout_errors"]
        assert "dimensions ('dp', 'tp') does not say which one" in errors["unnamed_2d_mesh"]
        # what the user gives is taken as it is, even where it disagrees with the strategy's mesh
        assert (errors["world_given"], errors["tp_given"], errors["dp_given_size"], errors["found"]) == ("4", "2", "2", "2")
        assert errors["loss_world"] == "0.0"


# -- the rules that need no process group -----------------------------------------------------------


class _Strategy:
    def __init__(self, world_size: int, num_replicas: int) -> None:
        self.world_size = world_size
        self.distributed_sampler_kwargs = {"num_replicas": num_replicas, "rank": 0}


def test_from_the_strategy_one_device_ddp_and_an_unreadable_layout() -> None:
    assert data_parallel_group(strategy=_Strategy(1, 1)).size == 1
    ddp = data_parallel_group(strategy=_Strategy(4, 4))
    assert (ddp.group, ddp.size) == (None, 4)
    with pytest.raises(ValueError, match="splits the data over 2 replicas among 4 processes"):
        data_parallel_group(strategy=_Strategy(4, 2))
    assert data_parallel_group().size == 1  # no torch.distributed: nothing to reduce


class _Group:
    def __init__(self, size: int, ranks: list[int]) -> None:
        self.ranks = ranks
        self._size = size

    def size(self) -> int:
        return self._size


def test_found_by_itself_the_world_a_mesh_group_or_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # the decision on the device mesh dimensions this process holds, with torch.distributed stood in
    # for (4 processes): no mesh -> the world (DDP, and plain groups of the user's are never read); a
    # "data_parallel" dimension -> it; only data parallel dimensions (hybrid-sharded FSDP) -> the world;
    # a model parallel or unnamed dimension and no data parallel one, or two that disagree -> an error
    from lightning_kl.ground import parallel

    monkeypatch.setattr(parallel.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(parallel.dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(parallel.dist, "get_process_group_ranks", lambda g: g.ranks)
    dims: list[tuple[str, Any]] = []
    monkeypatch.setattr(parallel, "_mesh_groups", lambda: dims)
    assert (data_parallel_group().group, data_parallel_group().size) == (None, 4)
    dp = _Group(2, [0, 2])
    dims = [("data_parallel", dp), ("tensor_parallel", _Group(2, [0, 1]))]
    assert (data_parallel_group().group, data_parallel_group().size) == (dp, 2)
    for names in (("replicate", "shard"), ("dp_replicate", "dp_shard"), ("replicate_shard",)):
        dims = [(name, _Group(2, [0, 1])) for name in names]
        assert (data_parallel_group().group, data_parallel_group().size) == (None, 4), names
    dims = [("tensor_parallel", _Group(1, [0]))]  # Lightning's FSDP2 mesh (2, 1): data_parallel is the world's group
    assert (data_parallel_group().group, data_parallel_group().size) == (None, 4)
    for names, shown in ((("dp", "tp"), "['tp']"), (("dim_0", "dim_1"), "['dim_0', 'dim_1']"), (("dp_shard_cp",), "['dp_shard_cp']")):
        dims = [(name, _Group(2, [0, 1])) for name in names]
        with pytest.raises(ValueError, match=rf"dimensions {re.escape(shown)} \(model parallel, or unnamed\) and none named 'data_parallel'"):
            data_parallel_group()
        given = _Group(2, [0, 1])
        monkeypatch.setattr(parallel.dist, "get_rank", lambda group=None: 0)
        monkeypatch.setattr(parallel.dist, "ProcessGroup", _Group)
        assert data_parallel_group(process_group=given).group is given  # a group given wins: nothing found
    dims = [("data_parallel", dp), ("data_parallel", _Group(2, [0, 1]))]
    with pytest.raises(ValueError, match="several data parallel mesh groups"):
        data_parallel_group()


@pytest.mark.parametrize("make", [lk.KLPenaltyLoss, lk.KLMetric, lk.KLRewardCallback])
def test_bad_group_arguments_fail_at_construction(make: Any) -> None:
    with pytest.raises(TypeError, match="`process_group` must be a torch.distributed ProcessGroup.*got str"):
        make(process_group="dp")
    with pytest.raises(TypeError, match="`device_mesh` must be a torch DeviceMesh, got int"):
        make(device_mesh=2)


def test_a_group_that_does_not_hold_this_process_is_named() -> None:
    # what new_group returns to the processes outside the group (an int, -100, in torch 2.x)
    import torch.distributed as dist

    with pytest.raises(ValueError, match="`process_group` given does not hold this process"):
        lk.KLMetric(process_group=dist.GroupMember.NON_GROUP_MEMBER)


def test_a_group_and_a_mesh_together_are_refused() -> None:
    with pytest.raises(ValueError, match="as `process_group` or as `device_mesh`, not both"):
        check_parallel_args(object(), object())


@pytest.mark.filterwarnings(
    "ignore:LightningCLI's args parameter is intended",  # the config is parsed in-process on purpose
    "ignore:(?s).*Dump of a value that does not round-trip",  # the example's tuple of LoRA target names
)
def test_the_fsdp2_example_config_makes_a_model_parallel_trainer_of_2_processes() -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    path = Path(__file__).resolve().parents[1] / "examples" / "hf_grpo.py"
    spec = importlib.util.spec_from_file_location("hf_grpo_fsdp2_config", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    config = path.parent / "configs" / "hf_grpo_fsdp2.yaml"
    cli = example.main(["--config", str(config), "--trainer.logger=false"], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ModelParallelStrategy) and cli.trainer.num_devices == 2
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (2, 1)
    assert callable(cli.model.configure_model) and not cli.model.sharded
