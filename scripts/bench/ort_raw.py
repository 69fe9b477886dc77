"""Raw images/s of the terrain model in Python's ONNX Runtime, for comparison with
`sluice-bench pipeline terrain`'s raw column: the same model, batch and session settings as the
worker's (intra-op threads chosen by ONNX Runtime, spinning off, memory patterns off, full graph
optimization), then with ONNX Runtime's defaults (spinning on).

    python scripts/bench/ort_raw.py MODEL.onnx [--batch 8] [--calls 5]

Needs `onnxruntime` and `numpy` (a venv with the version being compared).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort


def rate(session: ort.InferenceSession, batch: int, calls: int) -> float:
    rng = np.random.default_rng(7)
    feed = {
        "noisy": rng.standard_normal((batch, 1, 128, 128), dtype=np.float32),
        "sigma": np.full((batch,), 80.0, dtype=np.float32),
        "difficulty": np.linspace(1, 100, batch, dtype=np.float32),
    }
    session.run(None, feed)  # warm-up
    started = time.perf_counter()
    for _ in range(calls):
        session.run(None, feed)
    return batch * calls / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    worker = ort.SessionOptions()
    worker.add_session_config_entry("session.intra_op.allow_spinning", "0")
    worker.add_session_config_entry("session.inter_op.allow_spinning", "0")
    worker.enable_mem_pattern = False
    worker.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    for name, options in (("worker's settings", worker), ("ONNX Runtime's defaults", ort.SessionOptions())):
        session = ort.InferenceSession(args.model, options, providers=["CPUExecutionProvider"])
        print(f"onnxruntime {ort.__version__}, {name}: {rate(session, args.batch, args.calls):.2f} images/s at batch {args.batch}")


if __name__ == "__main__":
    main()
