"""The main job: check every kernel against the float64 reference on random data and time it.

Each op contributes a check: f(rng) -> list of (case, relative error, bound, microseconds or None).
Without a GPU: compile every kernel, run the reference on random data, say so plainly.
"""
from __future__ import annotations

import os
import time

import numpy as np

from . import _driver, cache, compiler, kernels


def compile_all(arch: str, ops=None) -> int:
    """Compile each registered instantiation; one line per kernel; non-zero on a failure, a spill or wgmma
    instructions that ptxas serialised."""
    from . import ops as _ops  # noqa: F401  (registers every op's kernels)
    failures = 0
    for op, specs in sorted(kernels.REGISTRY.items()):
        if ops and op not in ops:
            continue
        for spec in specs:
            t0 = time.perf_counter()
            try:
                compiled, where = spec.compile(arch)
            except Exception as exc:  # report and go on: every kernel gets its line
                failures += 1
                print(f"FAIL {spec.uri()}: {exc}")
                continue
            dt = time.perf_counter() - t0
            for name, r in compiled.resources.items():
                bad = r.spills > 0 or r.stack_frame > 0 or r.wgmma_serialized
                failures += bad
                tag = "SERIAL" if r.wgmma_serialized else "SPILL" if bad else "ok  "
                print(f"{tag} {spec.uri():90s} regs {r.registers:3d} spill {r.spills:4d} "
                      f"stack {r.stack_frame:4d} smem {r.static_smem:6d} {dt:6.2f}s ({where})")
    print(f"{failures} failure(s)")
    return 1 if failures else 0


def toolchain_report() -> str:
    """Where NVRTC and the headers came from (a partial system toolkit can hide a missing pip pin)."""
    dirs = compiler.include_dirs()
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
        lib = load_nvidia_dynamic_lib("nvrtc")
        where = f"{lib.abs_path} ({lib.found_via})"
    except Exception as exc:  # report, never fail the self-check on it
        where = f"unknown ({exc.__class__.__name__})"
    return (f"NVRTC {'.'.join(map(str, compiler.nvrtc_version()))} from {where}; headers "
            f"{cache.header_versions()} from {', '.join(dirs)}; cache {cache.cache_dir()}")


def run() -> int:
    from . import ops
    print(f"kvattn self-check; {toolchain_report()}")
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    if not _driver.gpu_available():
        status = compile_all("sm_90a")
        checked = ops.reference_checks(rng)
        bad = 0
        for name, err in checked:
            ok = err <= 1e-9
            bad += not ok
            print(f"reference {name}: max deviation {err:.2e} {'ok' if ok else 'FAIL'}")
        print("no CUDA GPU found: compiled every kernel for sm_90a and ran the float64 reference only "
              f"({len(checked)} reference checks, {bad} failed)")
        return 1 if status or bad else 0
    print(f"GPU: {_driver.device_name()} (sm_{''.join(map(str, _driver.compute_capability()))}, "
          f"{_driver.sm_count()} SMs)")
    failures = 0
    print(f"{'case':50s} {'rel err':>9s} {'bound':>8s} {'time':>10s}")
    for case, err, bound, us in ops.gpu_checks(rng):
        ok = np.isfinite(err) and err <= bound
        failures += not ok
        t = f"{us:8.1f}us" if us is not None else ""
        print(f"{case:50s} {err:9.2e} {bound:8.0e} {t:>10s} {'ok' if ok else 'FAIL'}")
    print("all checks passed" if not failures else f"{failures} check(s) FAILED")
    return 1 if failures else 0
