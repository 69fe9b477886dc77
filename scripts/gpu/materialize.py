"""Turns the SD-1.5-shaped skeleton (sd15-skeleton.tar.xz, from sd15_skeleton.py) into a loadable model.

For each model directory with a weights.json, writes its external data file (model.onnx_data)
with seeded random values: every tensor normal(mean, std) with the mean and std its exported
random init had, a constant where std is 0 (norm weights of ones, zero biases), in its dtype, at
its recorded offset. Values depend only on --seed (each chunk of CHUNK elements has its own
generator, so threads do not change them). Everything else (graphs, configs, tokenizer) is
copied as is, so OUT_DIR is an Optimum ONNX layout Sluice loads like the sd-tiny fixture.

Needs Python 3.10+ and numpy only:
    python materialize.py SKELETON_TAR_OR_DIR OUT_DIR [--seed N] [--threads N]
Prints one line per file written (tensors, bytes, seconds).
"""

import argparse
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

CHUNK = 1 << 22  # elements generated at a time


def skeleton_root(src: Path, tmp: Path) -> Path:
    """The directory holding model_index.json, unpacking `src` into `tmp` when it is a tarball."""
    if not src.is_dir():
        with tarfile.open(src) as tar:
            tar.extractall(tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        src = tmp
    roots = [p.parent for p in src.rglob("model_index.json")]
    if len(roots) != 1:
        sys.exit(f"{src}: expected one model_index.json, found {len(roots)}")
    return roots[0]


def chunk(t: dict, index: int, start: int, count: int, seed: int) -> tuple[int, np.ndarray]:
    """Elements [start, start + count) of tensor number `index`: (file offset, values)."""
    dtype = np.dtype(t["dtype"])
    if t["std"] == 0:
        a = np.full(count, t["mean"], dtype)
    else:
        a = np.random.default_rng([seed, index, start // CHUNK]).standard_normal(count, dtype=np.float32)
        a *= np.float32(t["std"])
        a += np.float32(t["mean"])
        a = a.astype(dtype, copy=False)
    return t["offset"] + start * dtype.itemsize, a


def write_data(weights: dict, path: Path, seed: int, threads: int) -> None:
    jobs = []
    for i, t in enumerate(weights["tensors"]):
        if np.dtype(t["dtype"]).kind != "f":
            sys.exit(f"{path}: {t['name']} is {t['dtype']}; only float tensors can be external")
        n = int(np.prod(t["shape"], dtype=np.int64))
        if n * np.dtype(t["dtype"]).itemsize != t["length"]:
            sys.exit(f"{path}: {t['name']}: shape {t['shape']} does not match length {t['length']}")
        jobs += [(t, i, s, min(CHUNK, n - s)) for s in range(0, n, CHUNK)]
    with open(path, "wb") as f, ThreadPoolExecutor(threads) as pool:
        def write_next() -> None:
            offset, data = pending.popleft().result()
            f.seek(offset)  # gaps (alignment) read back as zeros
            f.write(data)

        pending = deque()
        for job in jobs:
            pending.append(pool.submit(chunk, *job, seed))
            if len(pending) > 2 * threads:
                write_next()
        while pending:
            write_next()
        f.truncate(weights["size"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("skeleton", type=Path, help="sd15-skeleton.tar.xz or its unpacked directory")
    ap.add_argument("out", type=Path, help="model directory to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    a = ap.parse_args()
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = skeleton_root(a.skeleton, Path(tmp))
        shutil.copytree(root, a.out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("weights.json"))
        for wj in sorted(root.rglob("weights.json")):
            weights = json.loads(wj.read_text())
            path = a.out / wj.parent.relative_to(root) / weights["file"]
            t1 = time.time()
            write_data(weights, path, a.seed, a.threads)
            print(f"{path}: {len(weights['tensors'])} tensors, {weights['size']:,} bytes, {time.time() - t1:.1f} s", flush=True)
    print(f"{a.out}: done in {time.time() - t0:.1f} s (seed {a.seed})")


if __name__ == "__main__":
    main()
