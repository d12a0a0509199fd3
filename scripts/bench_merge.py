"""merge_states bandwidth vs the copy ceiling (same process).

    PYTHONPATH=. python scripts/bench_merge.py
Bytes = states read + merged state written (o and lse).
"""
import numpy as np

from _bench import kvattn, random_device, table
from kvattn import reference
from kvattn.timing import copy_bandwidth_tbs, time_us


def main():
    rng = np.random.default_rng(0)
    ceiling = copy_bandwidth_tbs()
    rows = []
    for rows_, n, h, d, dt in [(16384, 4, 32, 128, "bfloat16"), (16384, 2, 32, 128, "float16"),
                               (4096, 8, 32, 128, "float32")]:
        o = random_device((rows_, n, h, d), dt, rng)
        lse_h = rng.uniform(-5, 5, (rows_, n, h)).astype(np.float32)
        lse = kvattn.from_numpy(lse_h)
        out, lo = kvattn.empty((rows_, h, d), dt), kvattn.empty((rows_, h), "float32")
        kvattn.merge_states(o, lse, out=out, lse_out=lo)
        us = time_us(lambda: kvattn.merge_states(o, lse, out=out, lse_out=lo))
        nbytes = o.nbytes + lse.nbytes + out.nbytes + lo.nbytes
        sample = slice(0, 64)
        ref, _ = reference.merge_states(o.numpy()[sample].astype(np.float64), lse_h[sample])
        err = np.linalg.norm(out.numpy()[sample] - ref) / np.linalg.norm(ref)
        tbs = nbytes / us / 1e6
        rows.append(dict(case=f"{rows_}x{n}x{h}x{d} {dt}", us=round(us, 1), TBps=round(tbs, 2),
                         frac=round(tbs / ceiling, 3), err=f"{err:.1e}"))
        print(rows[-1], flush=True)
    print(f"\nmerge_states; copy ceiling {ceiling:.2f} TB/s")
    table(rows, ["case", "us", "TBps", "frac", "err"])


if __name__ == "__main__":
    main()
