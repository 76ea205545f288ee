"""The pinned stacks' own distillation losses, read from their installed files, for ``bench_distill_peers.py``
and ``examples/topk_bias.py`` (which import it from this folder).

Nothing here copies their code: each function is taken out of the installed file by its syntax tree and
executed as it is, in a namespace that holds the names it reads (as ``tests/_mismatch_stacks.py`` does for
the tests). The stacks are installed without their dependencies (``pip install --no-deps --target .stacks
verl==0.9.1 trl==1.16.0``, the README's command); the folder is ``$LIGHTNING_KL_STACKS`` when set, else
``.stacks`` at the repository's root, else an importable package of the pinned version.

* TRL 1.16.0:
  - ``trl/experimental/gkd/gkd_trainer.py``: ``GKDTrainer.generalized_jsd_loss`` (a staticmethod), the
    full-vocabulary generalized JSD on ``[n, V]`` logits;
  - ``trl/kernels/chunked_divergence.py``: ``ChunkedDivergenceFunction``, the chunked generalized JSD from
    both models' hidden states and heads that ``DistillationTrainer`` (``trl/trainer/distillation_trainer.py``)
    calls; loaded as a module with ``kernels/chunked_logprob.py`` under a stand-in parent package (on a CPU
    its torch path);
  - ``trl/experimental/server_distillation/server_distillation_trainer.py``: ``_add_tail_bucket``,
    ``_jsd_divergence`` and the method ``_compute_sparse_top_1_divergence_loss`` of
    ``ServerDistillationTrainer`` (its top-1 support for ``beta > 0``).
* verl 0.9.1, ``verl/trainer/distillation/fsdp/losses.py``: ``compute_forward_kl_topk`` with its helpers
  ``kl_divergence`` and ``_chunked_topk_log_probs`` (sequence parallelism stubbed to one rank). Its caller
  (``verl/trainer/distillation/losses.py``, registered as ``forward_kl_topk``) then applies
  ``distillation_losses.clamp_min(0.0)``: :func:`verl_forward_kl_topk` returns both.

A missing package, or another version, raises :class:`StackMissing`, naming the install command.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.metadata
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
VERSIONS = {"verl": "0.9.1", "trl": "1.16.0"}


class StackMissing(RuntimeError):
    """The pinned package is not installed (or another version is)."""


def package_root(name: str) -> Path:
    """The installed package's folder: under ``$LIGHTNING_KL_STACKS`` or ``.stacks``, else importable."""
    folder = os.environ.get("LIGHTNING_KL_STACKS") or (str(ROOT / ".stacks") if (ROOT / ".stacks").is_dir() else "")
    if folder:
        for dist in importlib.metadata.distributions(path=[folder]):
            if (dist.metadata["Name"] or "").lower() == name:
                if dist.version != VERSIONS[name]:
                    raise StackMissing(f"{name} {dist.version} is in {folder}; this reads {name} {VERSIONS[name]}")
                return Path(folder) / name
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        raise StackMissing(
            f"{name} is not installed: pip install --no-deps --target .stacks {name}=={VERSIONS[name]} "
            "(or into another DIR with LIGHTNING_KL_STACKS=DIR)"
        ) from None
    if version != VERSIONS[name]:
        raise StackMissing(f"{name} {version} is installed; this reads {name} {VERSIONS[name]}")
    spec = importlib.util.find_spec(name)  # the folder, without running the package's __init__
    assert spec is not None and spec.submodule_search_locations
    return Path(list(spec.submodule_search_locations)[0])


def _function(path: Path, name: str, namespace: dict[str, Any]) -> Callable:
    """The function (or method) ``name`` of the file, compiled alone in ``namespace``, its decorators dropped."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            fn = ast.FunctionDef(name=node.name, args=node.args, body=node.body, decorator_list=[], returns=None,
                                 type_comment=None, type_params=[])  # fmt: skip
            module = ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[]))
            exec(compile(module, f"<{path.name}: {name}>", "exec"), namespace)
            return namespace[name]
    raise StackMissing(f"no function {name} in {path}")


def _torch_namespace() -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    return {"torch": torch, "F": F, "Any": Any, "Optional": Optional}


def trl_generalized_jsd_loss() -> Callable:
    """TRL's ``GKDTrainer.generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta=0.5,
    temperature=1.0, reduction="batchmean", num_items_in_batch=None)``."""
    path = package_root("trl") / "experimental" / "gkd" / "gkd_trainer.py"
    return _function(path, "generalized_jsd_loss", _torch_namespace())


def trl_chunked_divergence() -> Any:
    """TRL's ``ChunkedDivergenceFunction`` (``kernels/chunked_divergence.py``), the kernel of ``DistillationTrainer``.

    Its module imports ``maybe_gather_lm_head_ctx`` from ``..trainer.utils`` (a ZeRO-3 gather, a null context
    without DeepSpeed, as TRL makes it) and ``.chunked_logprob``: both modules are loaded under a stand-in
    parent package that gives that null context. ``transformers`` (for ``is_triton_available``) is imported
    when installed, else stood in for by a module that says no Triton."""
    kernels = package_root("trl") / "kernels"
    pkg = "_lk_trl_alone"
    if f"{pkg}.kernels.chunked_divergence" in sys.modules:
        return sys.modules[f"{pkg}.kernels.chunked_divergence"].ChunkedDivergenceFunction
    if importlib.util.find_spec("transformers") is None:
        stand_in = types.ModuleType("transformers.utils")
        stand_in.is_triton_available = lambda: False  # type: ignore[attr-defined]
        sys.modules.setdefault("transformers", types.ModuleType("transformers"))
        sys.modules["transformers.utils"] = stand_in
    for name in (pkg, f"{pkg}.kernels", f"{pkg}.trainer"):
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__path__ = []  # type: ignore[attr-defined]
    utils = types.ModuleType(f"{pkg}.trainer.utils")
    utils.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()  # type: ignore[attr-defined]
    sys.modules[utils.__name__] = utils
    module = None
    for name in ("chunked_logprob", "chunked_divergence"):
        spec = importlib.util.spec_from_file_location(f"{pkg}.kernels.{name}", kernels / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    assert module is not None
    return module.ChunkedDivergenceFunction


def trl_server() -> tuple[Callable, Callable, Callable]:
    """TRL's ``_add_tail_bucket(log_probs, valid_mask)``, ``_jsd_divergence(student, teacher, beta, support_mask)``
    and ``ServerDistillationTrainer._compute_sparse_top_1_divergence_loss`` as
    ``top1(beta, loss_add_tail, student_log_probs [n, V], teacher_top1_ids [n], teacher_top1_logprobs [n],
    sampled_ids [n], teacher_sampled_logprobs [n]) -> [n]``: its per-token divergence on the top-1 support
    (the teacher's top-1 and the sampled token for ``0 < beta < 1``, the sampled token alone for ``beta = 1``)
    with its tail, before the method's reduction (a stand-in ``self`` returns the cells, summed here)."""
    path = package_root("trl") / "experimental" / "server_distillation" / "server_distillation_trainer.py"
    ns = _torch_namespace()
    add_tail = _function(path, "_add_tail_bucket", ns)
    jsd = _function(path, "_jsd_divergence", ns)
    method = _function(path, "_compute_sparse_top_1_divergence_loss", ns)

    def top1(beta: float, loss_add_tail: bool, student_log_probs: Any, teacher_top1_ids: Any, teacher_top1_logprobs: Any,
             sampled_ids: Any, teacher_sampled_logprobs: Any) -> Any:  # fmt: skip
        me = types.SimpleNamespace(beta=beta, loss_add_tail=loss_add_tail,
                                   _reduce_divergence_loss=lambda jsd, **kw: jsd.sum(-1))  # fmt: skip
        labels = sampled_ids.new_zeros(sampled_ids.shape)  # no -100: every position counts
        return method(me, student_log_probs, teacher_top1_ids, teacher_top1_logprobs, sampled_ids,
                      teacher_sampled_logprobs, labels)  # fmt: skip

    return add_tail, jsd, top1


def verl_forward_kl_topk() -> Callable:
    """verl's ``compute_forward_kl_topk`` (FSDP) on ``[n, V]`` student logits and the teacher's ``[n, k]`` top-k,
    as ``f(logits, ids, logprobs, use_chunked_topk=False, log_prob_min_clamp=None) -> (clamped, raw, outputs)``:
    ``raw`` its ``distillation_losses`` (``[n]``, float32), ``clamped`` that after the registry's
    ``clamp_min(0.0)``, ``outputs`` the whole dict it returns (masses, overlap diagnostics). The teacher's
    tensors go in as the jagged nested tensors verl's batch holds (one sequence of ``n`` tokens)."""
    import logging

    import torch

    # building jagged nested tensors logs a note of torch.fx about is_fx_tracing, once per process: not ours to show
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    path = package_root("verl") / "trainer" / "distillation" / "fsdp" / "losses.py"
    ns = _torch_namespace()
    ns.update(get_ulysses_sequence_parallel_world_size=lambda: 1, slice_input_tensor=None,
              DistillationConfig=object, DistillationLossConfig=object)  # fmt: skip
    for name in ("_chunked_topk_log_probs", "kl_divergence"):
        _function(path, name, ns)
    compute = _function(path, "compute_forward_kl_topk", ns)

    def f(logits: Any, ids: Any, logprobs: Any, use_chunked_topk: bool = False,
          log_prob_min_clamp: Optional[float] = None) -> tuple[Any, Any, dict[str, Any]]:  # fmt: skip
        loss_config = types.SimpleNamespace(use_chunked_topk=use_chunked_topk, log_prob_min_clamp=log_prob_min_clamp)
        config = types.SimpleNamespace(distillation_loss=loss_config)
        nested_lp = torch.nested.nested_tensor_from_jagged(logprobs, offsets=torch.tensor([0, logprobs.shape[0]]))
        nested_ids = torch.nested.nested_tensor_from_jagged(ids, offsets=torch.tensor([0, ids.shape[0]]))
        out = compute(student_logits=logits.unsqueeze(0), teacher_topk_log_probs=nested_lp,
                      teacher_topk_ids=nested_ids, config=config, data_format="thd")  # fmt: skip
        raw = out["distillation_losses"][0]
        return raw.clamp_min(0.0), raw, out  # the clamp: verl/trainer/distillation/losses.py, forward_kl_topk

    return f
