"""The first vector-math call of a process is made by ``import lightning_kl``, in the importing thread.

oneMKL (in torch's CPU wheels) picks its vector-math kernels at the first ``exp``/``log``-like call
of a process and keeps the choice in a static variable, -1 until then. Two threads making that first
call together can run the wrong kernel for it (``lightning_kl/ground/vector_math.py``). The tests
start a fresh interpreter, import torch, and read that variable before and after ``import
lightning_kl``: -1 before, set after. They find it from the exported function that reads it
(``mkl_vml_serv_cpu_detect``, whose first instruction loads it relative to itself); on a torch
without that oneMKL they skip, saying why. A portable second test records, with a torch dispatch
mode, that an ``exp`` runs in the importing thread during the import.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent(
    r"""
    import ctypes, json, os, threading
    import torch

    def cpu_type():
        path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
        try:
            fn = ctypes.cast(ctypes.CDLL(path).mkl_vml_serv_cpu_detect, ctypes.c_void_p).value
        except (OSError, AttributeError) as e:
            return None, f"no oneMKL vector-math dispatch in this torch ({e})"
        code = ctypes.string_at(fn, 6)
        if code[:2] != b"\x8b\x05":  # mov eax, [rip + rel32]: the load of the cached choice
            return None, f"unknown code at mkl_vml_serv_cpu_detect ({code.hex()})"
        rel = int.from_bytes(code[2:6], "little", signed=True)
        return ctypes.c_int32.from_address(fn + 6 + rel), ""

    var, why = cpu_type()
    before = None if var is None else var.value
    import lightning_kl
    after = None if var is None else var.value
    print(json.dumps({"before": before, "after": after, "why": why, "threads": threading.active_count()}))
    """
)

DISPATCH_PROBE = textwrap.dedent(
    r"""
    import json, threading
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    VECTOR_MATH = {"exp", "exp_", "log", "log_", "expm1", "expm1_", "log1p", "log1p_"}
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in VECTOR_MATH:
                t = args[0]
                seen.append([name, str(t.dtype), t.device.type, threading.current_thread() is threading.main_thread()])
            return func(*args, **(kwargs or {}))

    with Record():
        import lightning_kl
    print(json.dumps(seen))
    """
)


def _run(code: str):
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_package_makes_the_first_vector_math_call() -> None:
    found = _run(PROBE)
    if found["before"] is None:
        pytest.skip(found["why"])
    if found["before"] != -1:
        pytest.skip(f"importing torch already made a vector-math call here (choice {found['before']}): nothing to settle")
    # set by the import (the value is the kernel family chosen for this CPU: 0 on this machine's AMD)
    assert found["after"] != -1, "import lightning_kl left oneMKL's vector-math choice unmade"
    assert found["threads"] == 1  # and no Python thread of ours exists that could have raced it


def test_the_import_runs_an_exp_on_the_cpu_in_the_importing_thread() -> None:
    seen = _run(DISPATCH_PROBE)
    assert seen, "no exp/log ran during import lightning_kl"
    name, dtype, device, main_thread = seen[0]
    assert device == "cpu" and dtype in ("torch.float64", "torch.float32") and main_thread, seen[0]
