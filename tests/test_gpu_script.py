"""``benchmarks/gpu.py``: the smoke run on CPU writes the table and the JSON, every case and every
sync-debug call ran or was reported, and its CUDA-only measurement path does what it says (driven
here by stand-ins for ``torch.cuda``'s clock and allocator, since the suite has no GPU)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_kl as lk
from lightning_kl.estimators import SAMPLED_ESTIMATORS

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu.py"


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("lightning_kl_gpu_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gpu = _load()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, str]:
    out = tmp_path_factory.mktemp("gpu_smoke")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu.json").read_text()), (out / "gpu.md").read_text(), proc.stdout


def test_smoke_run_writes_every_case_and_every_sync_call(smoke):
    data, md, stdout = smoke
    cases = data["cases"]
    assert len(cases) == len(gpu.build_cases(gpu.SMOKE_SHAPES, torch.device("cpu"), ("bfloat16", "float32")))
    assert {c["group"] for c in cases} == {"estimators", "logprobs-logits", "logprobs-hidden", "full-logits", "full-hidden", "sequence", "chunks"}
    for c in cases:
        if c["variant"].startswith(("trl", "liger")):
            # the anchors are not installed here, and Liger needs CUDA: reported, not silently dropped
            assert c["status"] == "skipped" and c["reason"], c
        else:
            assert c["status"] == "ok" and c["ms"] > 0, c
    estimators = {c["what"] for c in cases if c["group"] == "estimators"}
    assert estimators == {n for n in SAMPLED_ESTIMATORS if n not in ("kl", "mse", "kl+", "mse+")}
    # the sync-debug list: every call ran on CPU, and every public name is covered
    assert data["coverage"] == {"missing": [], "stale": []}
    assert [s["name"] for s in data["sync_debug"]] == [c.name for c in gpu.SYNC_CALLS]
    # on CPU the check refuses host reads: each call read the host exactly where its mark says it does
    for s, call in zip(data["sync_debug"], gpu.SYNC_CALLS):
        if call.syncs is None or (call.kind == "read" and not gpu.package_reads(torch.device("cpu"))):
            assert s["status"] == "no host read", s
        elif call.kind == "copy":
            assert s["status"] == "no host read (a copy to the device: CUDA only)", s
        else:
            assert s["status"] == "host read (expected)" and "synchronizing on CUDA" in s["where"], s
    # the markdown: one row per case and per sync call
    for c in cases:
        assert f"| `{c['what']}` | {c['size']} | {c['dtype']} | {c['variant']} |" in md
    for s in data["sync_debug"]:
        assert f"| {s['name']} |" in md
    assert f"[{len(cases)}/{len(cases)}" in stdout  # progress printed


def test_the_table_can_be_written_again_from_the_json_of_a_run(smoke, tmp_path):
    data, md, _ = smoke
    (tmp_path / "run.json").write_text(json.dumps(data))
    assert gpu.main(["--from-json", str(tmp_path / "run.json"), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "gpu.md").read_text() == md
    data = {k: v for k, v in data.items() if k != "elapsed_s"}  # a run cut short: the JSON after its last case
    (tmp_path / "cut.json").write_text(json.dumps(data))
    assert gpu.main(["--from-json", str(tmp_path / "cut.json"), "--out", str(tmp_path / "cut")]) == 0
    assert "The run did not finish." in (tmp_path / "cut" / "gpu.md").read_text()


def test_smoke_rows_agree_with_the_librarys_value(smoke):
    """Every anchor row that ran computed the same forward value as the library, on the same inputs."""
    data, _, _ = smoke
    compared = 0
    for c in data["cases"]:
        if c["reference"] or c["status"] != "ok":
            continue
        assert c["max_abs_diff"] is not None, c
        assert c["max_abs_diff"] < 1e-4, c  # float32 maths on both sides; the sequence level's value is the token level's
        compared += 1
    assert compared >= 30


def test_every_public_name_is_called_or_declared_host_only():
    cov = gpu.coverage()
    assert cov == {"missing": [], "stale": []}
    for call in gpu.SYNC_CALLS:
        assert call.covers, call.name


class FakeCuda:
    """``torch.cuda``'s synchronize, events and allocator statistics, recorded, on the host clock."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.allocated = 1000 * gpu.MIB
        self.peak = self.allocated
        fake = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.t: float = 0.0

            def record(self) -> None:
                fake.log.append("record")
                self.t = time.perf_counter()

            def synchronize(self) -> None:
                fake.log.append("event.synchronize")

            def elapsed_time(self, end: "Event") -> float:
                return (end.t - self.t) * 1e3

        self.Event = Event

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "Event", self.Event)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.log.append("synchronize"))
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def reset(self, device: Any = None) -> None:
        self.log.append("reset_peak")
        self.peak = self.allocated

    def step(self, seconds: float = 0.0, extra_mib: int = 300) -> Any:
        def step(keep: bool) -> Any:
            self.log.append("step")
            self.peak = max(self.peak, self.allocated + extra_mib * gpu.MIB)  # a transient allocation
            time.sleep(seconds)
            return torch.ones(3) if keep else None

        return step


def test_cuda_path_synchronizes_around_every_timing_and_resets_the_peak(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    dev = gpu.Device(torch.device("cuda", 0))
    cleared = []
    m = gpu.measure(fake.step(extra_mib=300), lambda: cleared.append(1), dev, budget_s=60.0, max_reps=4)
    assert m.status == "ok" and len(m.ms_all) == 4 and len(cleared) == 5  # warm-up + 4, each cleared
    assert m.peak_mib == pytest.approx(300)  # above the allocation before the timed steps
    assert torch.equal(m.value, torch.ones(3, dtype=torch.float64))
    # every step: the device idle first, events around it, then wait for the end event
    timed = ["synchronize", "record", "step", "record", "event.synchronize"]
    log = fake.log
    assert log[:5] == timed  # the warm-up
    # then the peak is reset on an idle device, after the warm-up's one-time allocations
    assert log[5:] == ["synchronize", "reset_peak"] + timed * 4


def test_a_case_whose_first_iteration_overruns_is_reported_not_repeated(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    dev = gpu.Device(torch.device("cuda", 0))
    m = gpu.measure(fake.step(seconds=0.05), lambda: None, dev, budget_s=0.01, max_reps=10)
    assert m.status == "skipped" and "first iteration" in m.reason and m.ms is None
    assert fake.log.count("step") == 1


def test_repetitions_stop_before_the_budget_runs_out(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    m = gpu.measure(fake.step(seconds=0.03), lambda: None, gpu.Device(torch.device("cuda", 0)), budget_s=0.1, max_reps=10)
    # 0.03 s a step: the warm-up and two timed steps fit in 0.1 s, a third would not
    assert m.status == "ok" and 1 <= len(m.ms_all) <= 3


def test_a_case_predicted_to_overrun_is_skipped_before_it_starts():
    budget = gpu.Budget(total_s=100.0, case_s=5.0)
    case = gpu.Case("full-logits", "full_kl", "16384", 16384, "bfloat16", "naive", build=lambda: None)  # type: ignore[arg-type]
    last = {case.series: (4096, 2.0)}  # 2 s at 4096 tokens: 8 s predicted at 16384
    reason = gpu._skip_reason(case, gpu.Device(torch.device("cpu")), budget, last)
    assert "predicted 8.0 s" in reason
    # 0.5 s at 4096: 2 s predicted, a warm-up and a timed iteration fit in 5 s
    assert gpu._skip_reason(case, gpu.Device(torch.device("cpu")), budget, {case.series: (4096, 0.5)}) == ""
    assert "predicted 3.2 s" in gpu._skip_reason(case, gpu.Device(torch.device("cpu")), budget, {case.series: (4096, 0.8)})
    spent = gpu.Budget(total_s=0.0, case_s=5.0)
    assert "total budget" in gpu._skip_reason(case, gpu.Device(torch.device("cpu")), spent, {})


def test_the_watchdog_writes_and_ends_a_case_that_hangs():
    hung, ended = [], threading.Event()
    dog = gpu.Watchdog(0.05, hung.append, poll_s=0.01, end=lambda code: ended.set())
    with dog.watching("slow case"):
        assert ended.wait(5.0)
    assert hung == ["slow case"]
    quiet, quiet_end = [], threading.Event()
    dog = gpu.Watchdog(5.0, quiet.append, poll_s=0.01, end=lambda code: quiet_end.set())
    with dog.watching("fast case"):
        time.sleep(0.05)
    assert quiet == [] and not quiet_end.is_set()


def test_oom_and_anchor_errors_are_reported_and_the_run_goes_on(tmp_path):
    report = gpu.Report(tmp_path, {"smoke": True}, {})

    def oom() -> Any:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    def broken() -> Any:
        raise TypeError("forward() takes 4 positional arguments but 5 were given")

    ok = gpu.Case("g", "w", "1", 1, "float32", "lightning-kl", lambda: (lambda keep: torch.ones(2), lambda: None), reference=True)
    cases = [gpu.Case("g", "w", "1", 1, "float32", "naive", oom), gpu.Case("g", "w", "1", 1, "float32", "anchor", broken), ok]
    dog = gpu.Watchdog(60.0, report.hung)
    gpu.run_cases(cases, gpu.Device(torch.device("cpu")), gpu.Budget(60.0, 10.0), 2, report, dog)
    rows = json.loads((tmp_path / "gpu.json").read_text())["cases"]
    assert [r["status"] for r in rows] == ["oom", "error", "ok"]
    assert "9.00 GiB" in rows[0]["reason"] and "TypeError" in rows[1]["reason"]


def test_without_cuda_the_gpu_run_refuses_and_points_to_smoke(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.main(["--out", str(tmp_path)]) == 2
    assert "--smoke" in capsys.readouterr().err
    assert not (tmp_path / "gpu.json").exists()


def test_the_cpu_check_refuses_host_reads_and_puts_every_method_back():
    import _gpu_sync  # benchmarks/, on the path since gpu.py was loaded

    before = {name: getattr(torch.Tensor, name) for name in _gpu_sync.HOST_READS}
    nonzero = torch.nonzero
    for read in (lambda t: t.item(), lambda t: bool(t), lambda t: float(t), lambda t: t.nonzero(), lambda t: torch.nonzero(t), lambda t: t.tolist()):
        with pytest.raises(RuntimeError, match="synchronizing on CUDA"):
            with _gpu_sync.sync_debug(torch.device("cpu")):
                read(torch.ones(()))
    with _gpu_sync.sync_debug(torch.device("cpu")):
        torch.ones(3).mul(2).sum()  # device work without a read is fine
    assert {name: getattr(torch.Tensor, name) for name in _gpu_sync.HOST_READS} == before
    assert torch.nonzero is nonzero and torch.ones(()).item() == 1.0


def test_cases_are_labelled_with_the_calls_users_make():
    """No case is named after a deprecated function (``token_logprobs_from_hidden``...): the hidden-state
    cases name ``lk.token_logprobs(lk.FromHidden(...))`` and ``lk.full_kl(lk.FromHidden(...))``."""
    cases = gpu.build_cases(gpu.SMOKE_SHAPES, torch.device("cpu"), ("bfloat16",))
    whats = {c.group: set() for c in cases}
    for c in cases:
        whats[c.group].add(c.what)
    assert whats["logprobs-hidden"] == {"token_logprobs(FromHidden)"}
    assert whats["full-hidden"] == {"full_kl(FromHidden)"}
    assert whats["chunks"] == {"token_logprobs", "full_kl", "full_kl(FromHidden)"}
    deprecated = {"token_logprobs_from_hidden", "full_kl_from_hidden", "processed_logprobs", "processed_full_kl"}
    assert not any(c.what.split("(")[0] in deprecated for c in cases)
