"""``make gpu-quick``: the first command to give a newly lent GPU, in about three minutes on an H100 or H200.

    python -m bench.gpu.quick [--only NAME ...] [--out DIR] [--seconds 240] [--list]

Each check (bench/gpu/quick_checks.py) runs in a process of its own under a time limit: a check that hangs
or crashes costs its own limit and nothing more, and the rest still run. The whole run stays within
``--seconds``: a check starts with no more than what is left, and one with nothing left is a FAIL that says
so. Each prints PASS or FAIL with its figure; the checks' output goes to DIR/quick-checks.log as they run,
one section each (DIR: --out, else $GPU_OUT, else build/gpu-logs: few files, as a device command returns
few), and the summary to bench/results/gpu/<device>/quick.json and quick.md (copied to DIR). Exit status: 0
when every check passed, 1 when one failed, 2 at once, saying why, on a machine without a usable GPU.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from bench.gpu import common

RESULT = "QUICK-RESULT "  # the line a check's process ends with: this prefix, then its Outcome as JSON
LOG = "quick-checks.log"
CHECKS_MODULE = "bench.gpu.quick_checks"


@dataclass
class Outcome:
    """What a check found: whether it passed, its figure (one line), and the numbers behind it."""

    ok: bool
    figure: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Check:
    """A check: ``run()`` returns its Outcome (raising is a FAIL); ``seconds`` is its process's time limit."""

    name: str
    what: str
    seconds: int
    run: Callable[[], Outcome]


def child(name: str, module: str) -> int:
    """Runs check ``name`` of ``module`` here and prints its result line (a raise is a FAIL with the error)."""
    checks = {c.name: c for c in importlib.import_module(module).CHECKS}
    try:
        outcome = checks[name].run()
    except Exception as e:  # noqa: BLE001 - any failure of a check is its FAIL, with the reason
        traceback.print_exc()
        outcome = Outcome(False, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e) else ''}")
    sys.stdout.flush()
    print(RESULT + json.dumps(asdict(outcome), default=str), flush=True)
    return 0


def section(log: Path, start: int) -> list[str]:
    """The lines a check's process wrote to ``log`` from byte ``start`` on."""
    with open(log, "rb") as f:
        f.seek(start)
        return f.read().decode(errors="replace").splitlines()


def last_result(lines: list[str]) -> Optional[dict[str, Any]]:
    found = [ln for ln in lines if ln.startswith(RESULT)]
    return json.loads(found[-1][len(RESULT) :]) if found else None


def last_line(lines: list[str]) -> str:
    text = [ln.strip() for ln in lines if ln.strip()]
    return text[-1][:300] if text else "no output"


def run_check(check: Check, module: str, log_dir: Path, env: Optional[dict[str, str]] = None,
              limit: Optional[float] = None) -> dict[str, Any]:  # fmt: skip
    """Runs ``check`` in its own process (its own process group, all of it killed at the time limit: the
    check's, or ``limit`` when that is less), its output appended to ``log_dir``/quick-checks.log."""
    seconds_allowed = check.seconds if limit is None else max(1.0, min(check.seconds, limit))
    log = log_dir / LOG
    with open(log, "a") as out:
        out.write(f"===== {check.name}: {check.what} =====\n")
    start = log.stat().st_size
    cmd = [sys.executable, "-m", "bench.gpu.quick", "--child", check.name, "--checks", module]
    env = dict(env if env is not None else os.environ, PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    with open(log, "a") as out:
        p = subprocess.Popen(cmd, cwd=common.ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)  # fmt: skip
        try:
            rc: Any = p.wait(timeout=seconds_allowed)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the check and whatever it started (a pytest's workers)
            p.wait()
            rc = "timeout"
    seconds = time.monotonic() - t0
    lines = section(log, start)
    found = last_result(lines)
    if rc == "timeout":
        outcome = Outcome(False, f"timed out after {seconds_allowed:.0f} s (last output: {last_line(lines)})")
    elif found is None:
        outcome = Outcome(False, f"its process exited with {rc} before a result (last output: {last_line(lines)})")
    else:
        outcome = Outcome(**found)
    return {"name": check.name, "what": check.what, "status": "PASS" if outcome.ok else "FAIL",
            "figure": outcome.figure, "seconds": round(seconds, 1), "limit_s": round(seconds_allowed),
            "data": outcome.data}  # fmt: skip


def run_checks(checks: list[Check], module: str, log_dir: Path, env: Optional[dict[str, str]] = None,
               say: Callable[[str], None] = print, seconds: float = float("inf")) -> list[dict[str, Any]]:  # fmt: skip
    """Runs every check in turn within ``seconds`` in all, saying each result as it comes."""
    log_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + seconds
    results = []
    for check in checks:
        left = deadline - time.monotonic()
        if left < 1:
            r = {"name": check.name, "what": check.what, "status": "FAIL", "seconds": 0.0, "limit_s": 0, "data": {},
                 "figure": f"not run: the {seconds:.0f} s of the whole run were used up"}  # fmt: skip
            say(f"FAIL {check.name}: {r['figure']}")
            results.append(r)
            continue
        say(f"gpu-quick: {check.name}: {check.what} (at most {min(check.seconds, left):.0f} s) ...")
        r = run_check(check, module, log_dir, env, left)
        say(f"{r['status']} {check.name} ({r['seconds']:.0f} s): {r['figure']}")
        results.append(r)
    return results


def write_summary(results: list[dict[str, Any]], env: dict[str, Any], log_dir: Path,
                  root: Path = common.RESULTS) -> Path:  # fmt: skip
    """quick.json and quick.md under the device's results directory, copied to ``log_dir``."""
    rows = [[r["status"], r["name"], r["figure"], f"{r['seconds']:.0f} s"] for r in results]
    passed = sum(r["status"] == "PASS" for r in results)
    note = f"{passed} of {len(results)} checks passed; the checks' output: {LOG}, one section each."
    d = common.write("quick", "GPU quick check", {"passed": passed, "checks": results},
                     common.table(["", "check", "figure", "time"], rows), env, root=root, notes=[note])  # fmt: skip
    log_dir.mkdir(parents=True, exist_ok=True)
    for name in ("quick.json", "quick.md"):
        if (d / name).resolve() != (log_dir / name).resolve():
            shutil.copy(d / name, log_dir / name)
    return d


def default_log_dir() -> Path:
    return Path(os.environ.get("GPU_OUT") or common.ROOT / "build" / "gpu-logs")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these checks, in this order")
    p.add_argument("--out", type=Path, help="where the logs go (default $GPU_OUT, else build/gpu-logs)")
    p.add_argument("--seconds", type=float, default=240, help="time for the whole run (default 240)")
    p.add_argument("--list", action="store_true", help="list the checks and stop")
    p.add_argument("--child", help=argparse.SUPPRESS)  # run one check here (the parent's processes)
    p.add_argument("--checks", default=CHECKS_MODULE, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child, args.checks)
    checks = importlib.import_module(args.checks).CHECKS
    if args.list:
        for c in checks:
            print(f"{c.name:22} {c.seconds:4d} s  {c.what}")
        return 0
    unknown = set(args.only or []) - {c.name for c in checks}
    if unknown:
        p.error(f"no check named {', '.join(sorted(unknown))}: --list names them")
    common.require_gpu()
    by_name = {c.name: c for c in checks}
    chosen = [by_name[n] for n in dict.fromkeys(args.only)] if args.only else list(checks)  # in the order given
    log_dir = args.out or default_log_dir()
    t0 = time.monotonic()
    results = run_checks(chosen, args.checks, log_dir, seconds=args.seconds)
    d = write_summary(results, common.environment(), log_dir)
    failed = [r["name"] for r in results if r["status"] != "PASS"]
    print(f"gpu-quick: {len(results) - len(failed)} of {len(results)} passed in {time.monotonic() - t0:.0f} s"
          + (f"; failed: {', '.join(failed)}" if failed else "") + f". Summary: {d / 'quick.json'}; logs: {log_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
