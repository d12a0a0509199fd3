"""NVRTC: (source, options, name expressions) -> cubin, lowered names and the ptxas resource report."""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import time

from ._errors import CompileError, KvattnError


@dataclasses.dataclass(frozen=True)
class Resources:
    """What ptxas reported for one kernel (static shared memory only; dynamic is the launcher's)."""
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack_frame: int = 0
    static_smem: int = 0
    # ptxas serialised the kernel's wgmma instructions (its C7510-C7520 "Potential Performance Loss"): a correct
    # kernel that runs at a fraction of its speed (run 33a: -25%), so the compile step fails on it as on a spill
    wgmma_serialized: bool = False

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads

    def ctas_per_sm(self, threads: int, dynamic_smem: int, limit: int = 16) -> int:
        """CTAs of `threads` threads one SM holds (H100 / H200: 228 KB of shared memory, 1 KB reserved per CTA;
        64K registers, allocated per warp in units of 256)."""
        by_smem = (228 * 1024) // (dynamic_smem + self.static_smem + 1024)
        per_warp = -(-(self.registers or 255) * 32 // 256) * 256
        by_regs = 65536 // (-(-threads // 32) * per_warp)
        return max(1, min(by_smem, by_regs, limit))


@dataclasses.dataclass(frozen=True)
class Compiled:
    cubin: bytes
    lowered: dict          # name expression -> mangled name
    resources: dict        # mangled name -> Resources
    log: str
    seconds: float


def _nvrtc():
    from cuda.bindings import nvrtc
    return nvrtc


def _check(result, call, prog=None):
    nvrtc = _nvrtc()
    err = result[0]
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        detail = ""
        if prog is not None:
            detail = program_log(prog)
        raise KvattnError(f"{call} failed: {err.name}" + (f"\n{detail}" if detail else ""))
    return result[1] if len(result) == 2 else result[1:]


def program_log(prog) -> str:
    nvrtc = _nvrtc()
    err, n = nvrtc.nvrtcGetProgramLogSize(prog)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or n <= 1:
        return ""
    buf = b" " * n
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return buf.rstrip(b"\0 ").decode(errors="replace")


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    return tuple(_check(_nvrtc().nvrtcVersion(), "nvrtcVersion"))


@functools.lru_cache(maxsize=None)
def include_dirs() -> tuple[str, ...]:
    """Header folders for NVRTC: the CUDA runtime headers and CCCL (cuda/std), found by cuda-pathfinder."""
    from cuda.pathfinder import find_nvidia_header_directory
    dirs = []
    for lib in ("cudart", "cccl"):
        d = find_nvidia_header_directory(lib)
        if d is None:
            raise KvattnError(f"the CUDA '{lib}' headers were not found; install cuda-toolkit[nvrtc,cudart,cccl]==13.0.*")
        dirs.append(d)
    return tuple(dirs)


def source_dir() -> str:
    """cuda_src: inside the installed package (wheel) or next to the package in a checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    for cand in (os.path.join(here, "cuda_src"), os.path.join(os.path.dirname(here), "cuda_src")):
        if os.path.isdir(cand):
            return cand
    raise KvattnError(f"kvattn's CUDA sources (cuda_src) were not found next to {here}")


def compile_cubin(source: str, name: str, options, name_expressions, arch: str, files=None) -> Compiled:
    """Compile one translation unit to a cubin for `arch` (e.g. sm_90a). Raises CompileError with the log.
    files: {name: text} of the parts of source that a `#line 1 "name"` directive names (a user variant's
    snippet): an error there is shown with that part's own numbered lines."""
    nvrtc = _nvrtc()
    t0 = time.perf_counter()
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        for expr in name_expressions:
            _check(nvrtc.nvrtcAddNameExpression(prog, expr.encode()), "nvrtcAddNameExpression")
        opts = [f"-arch={arch}", "--std=c++17", "-default-device", "--ptxas-options=-v", *options]
        opts += [f"-I{d}" for d in (source_dir(), *include_dirs())]
        err, = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        log = program_log(prog)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(name, log, opts, _source_excerpt(source, log, files=files))
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize", prog)
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN", prog)
        lowered = {}
        for expr in name_expressions:
            low = _check(nvrtc.nvrtcGetLoweredName(prog, expr.encode()), "nvrtcGetLoweredName", prog)
            lowered[expr] = low.decode() if isinstance(low, bytes) else str(low)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return Compiled(cubin, lowered, parse_ptxas_report(log), log, time.perf_counter() - t0)


_LOC = re.compile(r"^(?P<file>[^\s(]+)\((?P<line>\d+)\): (?:error|warning)", re.M)


def _source_excerpt(source: str, log: str, context: int = 3, files=None) -> str:
    """Numbered lines around each error the log points at (the main source, a named part of it, or a cuda_src
    header)."""
    chunks = []
    for m in list(_LOC.finditer(log))[:5]:
        path, line = m.group("file"), int(m.group("line"))
        text = source
        if files and path in files:
            text = files[path]
        elif not path.endswith(".cu") or os.path.exists(path):
            cand = path if os.path.exists(path) else os.path.join(source_dir(), os.path.basename(path))
            if os.path.exists(cand):
                with open(cand) as f:
                    text = f.read()
        lines = text.splitlines()
        lo, hi = max(1, line - context), min(len(lines), line + context)
        chunks.append(f"{path}:\n" + "\n".join(
            f"{'>' if i == line else ' '}{i:5d} | {lines[i - 1]}" for i in range(lo, hi + 1)))
    if not chunks:
        lines = source.splitlines()
        chunks.append("\n".join(f" {i:5d} | {t}" for i, t in enumerate(lines[:40], 1)))
    return "\n".join(chunks)


_ENTRY = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_SERIALIZED = re.compile(r"wgmma\.mma_async instructions are serialized.* in the function '([^']+)'")


def parse_ptxas_report(log: str) -> dict:
    """{mangled kernel name: Resources} from a `--ptxas-options=-v` log."""
    out: dict = {}
    current = None
    frame = (0, 0, 0)
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            current = m.group(1)
            frame = (0, 0, 0)
            continue
        m = _ENTRY.search(line)
        if m:
            current = m.group(1)
            continue
        m = _FRAME.search(line)
        if m and current:
            frame = tuple(int(g) for g in m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            smem = re.search(r"(\d+) bytes smem", line)
            out[current] = Resources(int(m.group(1)), frame[1], frame[2], frame[0], int(smem.group(1)) if smem else 0)
    for name in _SERIALIZED.findall(log):
        out[name] = dataclasses.replace(out.get(name, Resources()), wgmma_serialized=True)
    return out
