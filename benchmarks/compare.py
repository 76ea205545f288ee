"""The working tree against a git ref on the headline CPU cases, in the default environment.

Each case runs in a fresh child process per tree, trees alternated, with ``PYTHONPATH`` at that
tree's root (each child imports its own ``lightning_kl``) and no ``OMP_*`` variable (the
environment users run in). A child times the library's call and the plain torch composition,
forward and backward, alternated in the same process, and reports the library's time as a ratio of
the composition's: the ratio cancels most of the machine's load of the moment. ``--busy N`` starts N
busy processes beside the children (one per core is a shared machine, or one DDP process per
core). The table gives, per case and tree, the median ratio over ``--repeat`` children (the range in
brackets), the goal, and the tree's time as a ratio of the ref's.

    python benchmarks/compare.py --against main
    python benchmarks/compare.py --against 452e35a --busy 2 --repeat 5
    python benchmarks/compare.py --against main --cases logprobs k3+

The ref is exported with ``git archive`` into a temporary folder (its tracked files only). A case
whose function a tree lacks is reported as skipped there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: (goal ratio or None, setup code defining `lib(inputs)`, `plain(inputs)` and `make()`)
CASES: dict[str, tuple[float | None, str]] = {
    "logprobs": (0.45, """
x0 = (torch.randn(1024, 151936) * 2).to(torch.bfloat16)
tokens = torch.randint(0, 151936, (1024,))
w = torch.randn(1024)
make = lambda: x0.clone().requires_grad_()
lib = lambda x: lk.token_logprobs(x, tokens).float().mul(w).sum().backward()
plain = lambda x: torch.log_softmax(x.float(), -1).gather(-1, tokens[:, None])[:, 0].mul(w).sum().backward()
"""),
    "k3+": (0.35, """
lp0, ref = -torch.rand(1024, 8192) * 5, -torch.rand(1024, 8192) * 5
make = lambda: lp0.clone().requires_grad_()
lib = lambda lp: lk.kl_penalty(lp, ref, "k3+").sum().backward()
def plain(lp):
    d = ref - lp
    k2 = 0.5 * (lp - ref) ** 2
    ((torch.exp(d) - 1 - d).detach() + k2 - k2.detach()).sum().backward()
"""),
    "full_kl-1024": (0.5, """
z0, zr = torch.randn(1024, 32768) * 2, torch.randn(1024, 32768) * 2
make = lambda: z0.clone().requires_grad_()
lib = lambda z: lk.full_kl(z, zr).sum().backward()
def plain(z):
    logp, logq = torch.log_softmax(z, -1), torch.log_softmax(zr, -1)
    (logp.exp() * (logp - logq)).sum(-1).sum().backward()
"""),
    "full_kl-2048": (0.5, """
z0, zr = torch.randn(2048, 32768) * 2, torch.randn(2048, 32768) * 2
make = lambda: z0.clone().requires_grad_()
lib = lambda z: lk.full_kl(z, zr).sum().backward()
def plain(z):
    logp, logq = torch.log_softmax(z, -1), torch.log_softmax(zr, -1)
    (logp.exp() * (logp - logq)).sum(-1).sum().backward()
"""),
    "logprobs+entropy-hidden": (None, """
if not hasattr(lk, "token_logprobs_and_entropy"):
    raise SystemExit("skip: no lk.token_logprobs_and_entropy")
h0, w0 = torch.randn(512, 896), torch.randn(151936, 896) * 0.05
tokens, a, b = torch.randint(0, 151936, (512,)), torch.randn(512), torch.randn(512)
make = lambda: (h0.clone().requires_grad_(), w0.clone().requires_grad_())
def lib(hw):
    lp, ent = lk.token_logprobs_and_entropy(lk.FromHidden(*hw), tokens)
    (lp * a + ent * b).sum().backward()
def plain(hw):
    logp = torch.log_softmax(torch.nn.functional.linear(*hw), -1)
    ent = -(logp.exp() * logp).sum(-1)
    (logp.gather(-1, tokens[:, None])[:, 0] * a + ent * b).sum().backward()
"""),
}

CHILD = """
import json, sys, time, torch
import lightning_kl as lk
assert lk.__file__.startswith(sys.argv[2]), (lk.__file__, sys.argv[2])
torch.manual_seed(0)
exec(sys.argv[1])
def once(f):
    x = make(); t = time.perf_counter(); f(x); return time.perf_counter() - t
once(lib), once(plain)  # warm-up
times = {"lib": [], "plain": []}
for _ in range(int(sys.argv[3])):
    times["lib"].append(once(lib)); times["plain"].append(once(plain))
print(json.dumps({k: min(v) for k, v in times.items()}))
"""


def _export(ref: str, into: str) -> str:
    """The tracked files of ``ref`` written under ``into``; returns the commit's short hash."""
    data = subprocess.run(["git", "-C", ROOT, "archive", ref], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", ref], check=True, capture_output=True, text=True).stdout.strip()


def _child(case: str, tree: str, reps: int, timeout: float) -> float | str:
    """The case's ratio lib / plain in a fresh child importing ``tree``'s package, or why not."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    env["PYTHONPATH"] = tree
    cmd = [sys.executable, "-c", CHILD, CASES[case][1], os.path.join(tree, "lightning_kl"), str(reps)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=tree)
    except subprocess.TimeoutExpired:
        return f"over {timeout:.0f} s"
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (out.stderr or out.stdout).strip().splitlines()
        return tail[-1][:60] if tail else f"exit {out.returncode}"
    r = json.loads(lines[-1])
    return r["lib"] / r["plain"]


def _cell(ratios: list[float | str]) -> str:
    nums = [r for r in ratios if isinstance(r, float)]
    if not nums:
        return str(ratios[0]) if ratios else "-"
    return f"{statistics.median(nums):.2f}x ({min(nums):.2f}-{max(nums):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", required=True, help="a git ref (branch, tag, commit)")
    parser.add_argument("--busy", type=int, default=0, help="busy processes beside the children")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--repeat", type=int, default=3, help="children per case and tree")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per child (the best is kept)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per child")
    args = parser.parse_args()

    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        with tempfile.TemporaryDirectory(prefix="lk_compare_") as tmp:
            ref_hash = _export(args.against, tmp)
            trees = {"tree": ROOT, args.against: tmp}
            rows = []
            for case in args.cases:
                got: dict[str, list[float | str]] = {name: [] for name in trees}
                for k in range(args.repeat):
                    order = list(trees.items()) if k % 2 == 0 else list(trees.items())[::-1]
                    for name, path in order:
                        got[name].append(_child(case, path, args.reps, args.timeout))
                mine, theirs = ([r for r in got[n] if isinstance(r, float)] for n in trees)
                vs = f"{statistics.median(mine) / statistics.median(theirs):.2f}x" if mine and theirs else "-"
                goal = CASES[case][0]
                rows.append((case, "-" if goal is None else f"<= {goal}x", _cell(got["tree"]), _cell(got[args.against]), vs))
    finally:
        for s in spinners:
            s.kill()
            s.wait()

    head = ("case", "goal", "tree", f"{args.against} ({ref_hash})", "tree / ref")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    print(f"lib / plain composition, fwd+bwd, median (range) of {args.repeat} children, {args.busy} busy processes, {os.cpu_count()} cores")
    for r in [head, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))


if __name__ == "__main__":
    main()
