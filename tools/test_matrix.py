"""The fast tests once per numerical setting of the CPU backends (`make test-matrix`).

A matrix product over another number of rows, or a sum split another way, may round
differently on another machine; tests that compare such results bitwise pass here and fail
there. Each setting below picks another code path on this machine:

  native          the defaults (none of the variables below set)
  mkl-sse4_2      MKL_ENABLE_INSTRUCTIONS=SSE4_2: MKL's SSE4.2 kernels (Intel CPUs only)
  mkl-avx2        MKL_ENABLE_INSTRUCTIONS=AVX2: MKL's AVX2 kernels (Intel CPUs only)
  mkl-compatible  MKL_CBWR=COMPATIBLE: MKL's vendor-neutral compatible path (any x86 CPU)
  aten-default    ATEN_CPU_CAPABILITY=default: PyTorch's own kernels without vector units
  aten-avx2       ATEN_CPU_CAPABILITY=avx2: PyTorch's AVX2 kernels (not AVX-512)
  omp-1           OMP_NUM_THREADS=1: one thread, so reductions are not split across threads

Usage: python tools/test_matrix.py [--settings NAME,NAME...] [--logs DIR] [pytest args...]
Every other argument (-k EXPR, a test file, -x, -n 2 ...) is passed to pytest. Each setting
runs `python -m pytest -m "not book" -q -p no:cacheprovider [args]` with the variables above
cleared from the environment and its own set; one line per setting, the full output in
DIR/NAME.log (default _build/test-matrix). Exits 1 if any setting had a failure or error.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

SETTINGS = {
    "native": {},
    "mkl-sse4_2": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "mkl-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "mkl-compatible": {"MKL_CBWR": "COMPATIBLE"},
    "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "omp-1": {"OMP_NUM_THREADS": "1"},
}
# Cleared before each run, so that "native" is native whatever the caller's shell sets.
VARIABLES = sorted({name for env in SETTINGS.values() for name in env})
PYTEST = ["-m", "pytest", "-m", "not book", "-q", "-p", "no:cacheprovider"]
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")


def counts(output: str) -> dict[str, int]:
    """The outcome counts of pytest's summary line ("3 failed, 10 passed, 1 error in 2.0s")."""
    summary = next((line for line in reversed(output.splitlines()) if re.search(
        r"(\d+ (passed|failed|errors?|skipped|xfailed|xpassed|deselected)|no tests ran)\b.* in "
        r"[\d.]+s", line)), "")
    found = {}
    for number, word in re.findall(r"(\d+) (\w+)", summary):
        word = "error" if word == "errors" else word
        if word in OUTCOMES:
            found[word] = int(number)
    return found


def cpu_model() -> str:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    return match.group(1).strip() if match else "unknown CPU"


def run(name: str, extra: list[str], logs: pathlib.Path) -> tuple[bool, str]:
    """Run the fast tests under one setting; (whether all passed, its line)."""
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    env.update(SETTINGS[name])
    start = time.monotonic()
    proc = subprocess.run([sys.executable, *PYTEST, *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    seconds = time.monotonic() - start
    output = proc.stdout + proc.stderr
    (logs / f"{name}.log").write_text(output)
    found = counts(output)
    ok = proc.returncode == 0
    setting = " ".join(f"{k}={v}" for k, v in SETTINGS[name].items()) or "(defaults)"
    shown = ", ".join(f"{found.get(word, 0)} {word}" for word in ("passed", "failed", "error"))
    shown += "".join(f", {found[word]} {word}" for word in OUTCOMES[3:] if found.get(word))
    if not found:
        shown = f"no summary (pytest exit code {proc.returncode})"
    elif not ok and not (found.get("failed") or found.get("error")):
        shown += f" (pytest exit code {proc.returncode})"
    line = f"{'ok  ' if ok else 'FAIL'} {name:15s} {setting:30s} {shown}  [{seconds:.0f} s]"
    return ok, line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], allow_abbrev=False,
        epilog="Other arguments go to pytest, e.g. -k TestRollingCache or tests/test_flash.py.")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help="comma-separated names among: " + ", ".join(SETTINGS))
    parser.add_argument("--logs", type=pathlib.Path, default=ROOT / "_build" / "test-matrix",
                        help="where each setting's full pytest output goes (NAME.log)")
    args, extra = parser.parse_known_args(argv)
    names = [n.strip() for n in args.settings.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown or not names:
        parser.error(f"unknown setting(s) {unknown}; choose among {', '.join(SETTINGS)}")
    args.logs.mkdir(parents=True, exist_ok=True)
    print(f"{cpu_model()}; pytest {shlex.join(PYTEST[2:] + extra)}", flush=True)
    failed = []
    for name in names:
        ok, line = run(name, extra, args.logs)
        print(line, flush=True)
        if not ok:
            failed.append(name)
    if failed:
        print(f"failed under {', '.join(failed)}: see {args.logs}/NAME.log "
              "(grep '^FAILED\\|^ERROR')")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
