"""Start one process per GPU for context parallelism and share the NCCL unique id (no torch.distributed):

    PYTHONPATH=. python3 scripts/launch_cp.py --nproc 2 scripts/bench_cp.py [its arguments]

Each child sees one GPU (CUDA_VISIBLE_DEVICES = its rank), NCCL_NVLS_ENABLE=0, and kvattn.cp's KVATTN_CP_RANK /
KVATTN_CP_WORLD / KVATTN_CP_UNIQUE_ID, from which kvattn.cp.communicator_from_env() builds its communicator. The
launcher exits with the first non-zero exit status of its children (0 when all pass).
"""
import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kvattn.cp import ENV_RANK, ENV_UID, ENV_WORLD  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, required=True, help="processes (one GPU each)")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    import nccl.core as nccl   # (the unique id is made here, once, and handed to every rank)
    uid = bytes(nccl.get_unique_id()).hex()
    procs = []
    for rank in range(a.nproc):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(rank), NCCL_NVLS_ENABLE="0",
                   **{ENV_RANK: str(rank), ENV_WORLD: str(a.nproc), ENV_UID: uid})
        procs.append(subprocess.Popen([sys.executable, a.script, *a.args], env=env))
    codes = [p.wait() for p in procs]
    bad = [c for c in codes if c]
    sys.exit(bad[0] if bad else 0)


if __name__ == "__main__":
    main()
