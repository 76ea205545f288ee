"""The Hugging Face on-policy distillation example (examples/hf_opd.py) at its smallest config
(examples/configs/hf_opd_tiny.yaml): a teacher and a student trained in code, then a few steps of OPD with the
teacher in both forms. The student's exact KL to the teacher on fixed sequences falls; the hidden states the loss
reads are the models' own logits'; the served top-k at k = V is the local teacher's loss; bad options fail at parse.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl import hf

pytestmark = [pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__` defined")]
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [ROOT / "examples" / "configs" / "hf_opd.yaml", ROOT / "examples" / "configs" / "hf_opd_tiny.yaml"]


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("hf_opd", ROOT / "examples" / "hf_opd.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["hf_opd"] = module
    spec.loader.exec_module(module)
    return module


ex = _load()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("models"))  # both models trained once, for every test here


@pytest.fixture
def one_thread(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(sys, "argv", ["hf_opd.py"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cli(tmp_path: Path, cache_dir: str, *args: str) -> Any:
    config = [a for path in CONFIGS for a in ("--config", str(path))]
    return ex.main([*config, f"--model.cache_dir={cache_dir}", f"--trainer.default_root_dir={tmp_path}", *args], run=False)


@pytest.mark.parametrize("form", ["hidden", "topk"])
def test_the_students_exact_kl_to_the_teacher_falls(form: str, tmp_path: Path, cache_dir: str, one_thread: Any) -> None:
    # a served top-8 of the 15 ids: the tiny teacher is less sure than the example's, and the tail hides more of it
    cli = _cli(tmp_path, cache_dir, f"--model.teacher_form={form}", "--model.topk=8")
    seen: list[dict[str, float]] = []

    import lightning.pytorch as pl

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            seen.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    cli.trainer.callbacks.append(Record())
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    module = cli.model
    assert len(seen) == cli.datamodule.hparams.rollouts
    # on the right answers to fixed problems: the same sequences before and after
    before, after = module.eval_kl_start, module.eval_kl_end
    assert before > 0.5 and after < 0.9 * before, (before, after)
    # on the student's own rollouts, as logged (the loss's quantity in the hidden form; its lower bound in topk)
    kl = [s["opd/kl_exact"] for s in seen]
    assert sum(kl[-4:]) < 0.75 * sum(kl[:4]), kl
    assert all(s["opd/loss"] <= s["opd/kl_exact"] + 1e-6 for s in seen)  # reverse: the coarsened one is at most the full
    if form == "topk":
        assert all(0 <= s["opd/teacher_tail"] <= 1 and 0 <= s["opd/student_tail"] <= 1 for s in seen)
    else:
        assert all(abs(s["opd/loss"] - s["opd/kl_exact"]) <= 1e-5 * max(1.0, s["opd/kl_exact"]) for s in seen)
        assert "opd/teacher_tail" not in seen[0]
    assert module.teacher_acc > 0.5  # the teacher trained in code knows the task


def _setup(tmp_path: Path, cache_dir: str, *args: str) -> tuple[Any, Any]:
    cli = _cli(tmp_path, cache_dir, *args)
    cli.trainer.strategy.connect(cli.model)
    cli.trainer.datamodule = cli.datamodule
    cli.model.trainer = cli.trainer
    cli.model.setup("fit")
    return cli.model, cli.datamodule


def test_the_hidden_states_are_those_of_the_models_own_logits(tmp_path: Path, cache_dir: str, one_thread: Any) -> None:
    module, dm = _setup(tmp_path, cache_dir)
    batch = dm.rollout(module)
    seq, am, mask = batch["sequences"], batch["attention_mask"], batch["mask"]
    p = seq.shape[1] - mask.shape[1]
    assert mask.any(-1).all()
    for model in (module.student, module.teacher):
        want = hf.response_logprobs(model, seq, am, p)
        got = lk.token_logprobs(hf.from_hidden(model, ex.response_hidden(model, seq, am, p)), seq[:, p:])
        assert_close(got[mask], want[mask], rtol=0, atol=1e-5)
    assert_close(batch["teacher_hidden"], ex.response_hidden(module.teacher, seq, am, p))


def test_the_served_topk_at_k_equal_to_v_is_the_local_teachers_loss(tmp_path: Path, cache_dir: str, one_thread: Any) -> None:
    V = ex.task.VOCAB_SIZE
    module, dm = _setup(tmp_path, cache_dir, "--model.teacher_form=topk", f"--model.topk={V}", "--model.divergence=jsd",
                        "--model.beta=0.3")
    batch = dm.rollout(module)
    seq, am, mask = batch["sequences"], batch["attention_mask"], batch["mask"]
    served = lk.TopK(batch["topk_ids"], batch["topk_logprobs"])
    assert (served.logprobs[~mask] == float("-inf")).all() and (served.logprobs[mask] <= 0).all()
    teacher = module.teacher.lm_head(batch["teacher_hidden"]).log_softmax(-1)
    assert_close(served.logprobs[mask], teacher.gather(-1, served.ids)[mask], rtol=0, atol=1e-6)
    student = lk.FromHidden(ex.response_hidden(module.student, seq, am, seq.shape[1] - mask.shape[1]), module.student.lm_head.weight)
    local = lk.FromHidden(batch["teacher_hidden"], module.teacher.lm_head.weight)
    topk_loss, local_loss = module.kl(student, served, mask), module.kl(student, local, mask)
    assert topk_loss > 0
    assert_close(topk_loss, local_loss, rtol=1e-4, atol=1e-6)
    g_topk = torch.autograd.grad(topk_loss, module.student.lm_head.weight, retain_graph=True)[0]
    g_local = torch.autograd.grad(local_loss, module.student.lm_head.weight)[0]
    assert_close(g_topk, g_local, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize(
    "arg,match",
    [
        ("--model.teacher_form=server", r"`teacher_form` must be one of \('hidden', 'topk'\)"),
        ("--model.topk=0", "`topk` must be an integer >= 1"),
        ("--model.divergence=kl", "divergence"),
    ],
)
def test_a_bad_option_fails_at_parse_naming_the_valid_values(arg: str, match: str, tmp_path: Path, one_thread: Any) -> None:
    with pytest.raises((ValueError, SystemExit)) as err:
        _cli(tmp_path, str(tmp_path), arg)
    if err.type is ValueError:
        assert err.match(match)


def test_a_forward_divergence_under_a_truncating_sampler_is_refused_at_setup(tmp_path: Path, cache_dir: str, one_thread: Any) -> None:
    with pytest.raises(ValueError, match=r"divergence='forward'.*truncating"):
        _setup(tmp_path, cache_dir, "--model.divergence=forward", "--data.sampling.top_p=0.9")


def test_the_served_topk_is_the_teachers_k_most_likely_ids_padded_after_the_response() -> None:
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(2, 3, 7, generator=g, dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    served = ex.served_topk(logits, mask, 3, temperature=0.5)
    lp = (logits / 0.5).log_softmax(-1)
    for b in range(2):
        for t in range(3):
            if mask[b, t]:
                order = sorted(range(7), key=lambda i: -float(lp[b, t, i]))[:3]
                assert served.ids[b, t].tolist() == order
                assert_close(served.logprobs[b, t], lp[b, t, order].float(), rtol=0, atol=1e-6)
            else:  # after the response: padding, no cell
                assert (served.logprobs[b, t] == float("-inf")).all()
    assert served.logprobs.dtype == torch.float32  # as a server sends them
