"""The machine code of kvattn's kernels, on a machine without a GPU (NVRTC compiles; nvdisasm reads the cubin):

    python3 scripts/sass.py loops [--head-dim 128] [--dtype bfloat16] [--paged] [--cta-a-unit] [--defines K=V,...]
    python3 scripts/sass.py digest OUT.json     # a digest of sampled instances' code: run on two trees, compare
    python3 scripts/sass.py compare A.json B.json

`loops`: the sm90 prefill instance's loops that issue wgmma or exp2 (a tile's steady loop, a unit's), each with its
instruction count and its commonest opcodes: what a change to the tile loop costs in code, before any GPU run
(BENCHMARKS.md session 34: the masked path's compares, the loop's size). `digest` / `compare`: whether a change left
the sampled default instances' code unchanged (line info left out), e.g. a refactor meant to change nothing, or
an A/B build that must equal the default it was timed as.
nvdisasm: $NVDISASM, else on PATH, else the registry package's (`pip install nvidia-cuda-nvdisasm`).
"""
import argparse
import collections
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kvattn import decode, prefill  # noqa: E402
from kvattn.variants import Variant  # noqa: E402

INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*$")
LABEL = re.compile(r"^\s*\.(L_x_\d+):")
BRANCH = re.compile(r"BRA\s+(?:\w+\s+)?`\(\.(L_x_\d+)\)")


def nvdisasm() -> str:
    found = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    found = found or next(iter(glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "*", "bin",
                                                      "nvdisasm"))), None)
    if not found:
        sys.exit("nvdisasm not found: set NVDISASM, or pip install nvidia-cuda-nvdisasm")
    return found


def disassemble(spec, arch="sm_90a") -> str:
    compiled, _ = spec.compile(arch)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.cubin)
        f.flush()
        return subprocess.run([nvdisasm(), "-c", f.name], capture_output=True, text=True, check=True).stdout


def opcode(text: str) -> str:   # "@!P1 HGMMA.64x128x16.F32 ..." -> "HGMMA"
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def loops(sass: str):
    """(start, end, opcode counts) of every backward branch's body."""
    ins, label_at, pending = [], {}, []
    for line in sass.splitlines():
        m = LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = INSTR.match(line)
        if m:
            addr = int(m.group(1), 16)
            for name in pending:
                label_at[name] = addr
            pending = []
            ins.append((addr, m.group(2)))
    index = {a: i for i, (a, _) in enumerate(ins)}
    for i, (addr, text) in enumerate(ins):
        m = BRANCH.search(text)
        if m and label_at.get(m.group(1), addr) < addr:
            start = label_at[m.group(1)]
            yield start, addr, collections.Counter(opcode(t) for _, t in ins[index[start]:i + 1])


def sampled_specs():
    """Default instances a kernel change could touch: sm90 prefill (plain / causal-capable, variants, head dims,
    persistent and a CTA a unit, ragged and paged), the sm80 prefill tiles and decode."""
    specs = {}
    for t in ("bfloat16", "float16"):
        for persistent in (True, False):
            for paged in (False, True):
                specs[f"sm90 {t} persistent={persistent} paged={paged}"] = prefill.sm90_spec(
                    128, Variant(), t, persistent=persistent, interleaved=paged)
    for d in (64, 256):
        specs[f"sm90 head_dim {d}"] = prefill.sm90_spec(d, Variant(), "bfloat16")
    for name, v in (("soft cap", Variant(soft_cap=True)), ("window", Variant(window=True)),
                    ("custom mask", Variant(custom_mask=True)), ("sinks", Variant(sink=True))):
        specs[f"sm90 {name}"] = prefill.sm90_spec(128, v, "bfloat16")
    for rows in prefill.CONFIGS:
        specs[f"sm80 prefill {rows} rows"] = prefill.prefill_spec(128, rows, Variant(), "bfloat16")
    for mt in (1, 2):
        specs[f"decode mt {mt}"] = decode.decode_spec(128, mt, Variant(), "bfloat16")
    return specs


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    lp = sub.add_parser("loops")
    lp.add_argument("--head-dim", type=int, default=128)
    lp.add_argument("--dtype", default="bfloat16")
    lp.add_argument("--paged", action="store_true")
    lp.add_argument("--cta-a-unit", action="store_true")
    lp.add_argument("--defines", default="", help="K=V,... (prefill.SM90_TUNING)")
    dp = sub.add_parser("digest")
    dp.add_argument("out")
    cp = sub.add_parser("compare")
    cp.add_argument("a")
    cp.add_argument("b")
    args = ap.parse_args()
    if args.cmd == "loops":
        prefill.SM90_TUNING = tuple((k, int(v)) for k, v in (kv.split("=") for kv in args.defines.split(",") if kv))
        sass = disassemble(prefill.sm90_spec(args.head_dim, Variant(), args.dtype, persistent=not args.cta_a_unit,
                                             interleaved=args.paged))
        print(f"{sum(1 for line in sass.splitlines() if INSTR.match(line))} instructions")
        for start, end, ops in loops(sass):
            if ops["HGMMA"] or ops["MUFU"] > 8:
                print(f"loop {start:05x}-{end:05x}: {sum(ops.values())} instructions, HGMMA {ops['HGMMA']}, "
                      f"MUFU {ops['MUFU']}; {', '.join(f'{k} {n}' for k, n in ops.most_common(10))}")
    elif args.cmd == "digest":
        digests = {name: hashlib.sha1(disassemble(spec).encode()).hexdigest() for name, spec in sampled_specs().items()}
        with open(args.out, "w") as f:
            json.dump(digests, f, indent=1)
        print(f"{len(digests)} instances -> {args.out}")
    else:
        a, b = (json.load(open(p)) for p in (args.a, args.b))
        for name in a:
            print(f"{name:40s} {'same' if a[name] == b.get(name) else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
