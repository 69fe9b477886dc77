"""The baseline Sluice is measured against: a plain Python consumer of terrain tasks, as a team
would write one in an afternoon instead of running Sluice. `sluice-bench pipeline terrain` runs it
as its last row, on the same stack, model, tasks and batch as the worker's rows.

confluent-kafka + onnxruntime + boto3 + Pillow, at least once: poll up to a batch of task records,
run them in one call, upload each PNG, then commit the batch's offsets. What it leaves out is what
Sluice adds: validation and the DLQ, completion and progress records, exactly-once, the crash
guard, cancels and deadlines, adaptive batches, metrics. Same ONNX Runtime session settings as
the worker (spinning off, memory patterns off, full graph optimization).

    python scripts/bench/peer_consumer.py --brokers HOST:PORT --topic TOPIC --model MODEL.onnx \
        --bucket BUCKET --prefix PREFIX --tasks N [--batch 8]

It reads TOPIC from its start in a group of its own, runs terrain tasks of one 128×128 map and
skips other records. S3 from the usual AWS_* variables (AWS_ENDPOINT_URL for a local server).
After N maps it prints one JSON line: the images done and the images/s from the first tenth of
uploads to the last, as the bench measures its end-to-end rows.
"""

from __future__ import annotations

import argparse
import io
import json
import time
import uuid

import boto3
import numpy as np
import onnxruntime as ort
from confluent_kafka import Consumer
from PIL import Image

SIGMA_MAX = 80.0
HEIGHT_RANGE = 22.16864
ASINH_SCALE = 0.1
# Height (share of the map's highest point) to colour: sea, beach, grass, rock, snow.
RAMP = [(0.0, (0.16, 0.35, 0.62)), (0.05, (0.86, 0.82, 0.6)), (0.3, (0.3, 0.6, 0.25)),
        (0.7, (0.5, 0.42, 0.35)), (1.0, (0.97, 0.97, 0.97))]


def session(model: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    options.enable_mem_pattern = False
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def is_tile(task: dict) -> bool:
    """A terrain task of one 128×128 map, all this consumer does (others are skipped)."""
    r = task.get("request", {})
    return task.get("model") == "terrain" and (r.get("width"), r.get("height"), r.get("num_images")) == (128, 128, 1)


def inputs(tasks: list[dict]) -> dict[str, np.ndarray]:
    noisy = np.stack([np.random.default_rng(t["request"]["seed"]).standard_normal((1, 128, 128), dtype=np.float32)
                      for t in tasks]) * SIGMA_MAX
    difficulty = [(t["request"]["params"].get("difficulty", 50) - 1) / 99 for t in tasks]
    return {"noisy": noisy, "sigma": np.full(len(tasks), SIGMA_MAX, dtype=np.float32),
            "difficulty": np.asarray(difficulty, dtype=np.float32)}


def png(denoised: np.ndarray) -> bytes:
    """A 128×128 map: model space to metres, floored at zero, coloured by height and hill-shaded."""
    unit = np.clip((denoised + 1) / 2, 0, 1)
    heights = np.clip(ASINH_SCALE * np.sinh(unit * np.arcsinh(HEIGHT_RANGE / ASINH_SCALE)), 0, HEIGHT_RANGE)
    heights -= heights.min()
    share = heights / max(float(heights.max()), 1e-6)
    stops = [p for p, _ in RAMP]
    colour = np.stack([np.interp(share, stops, [c[k] for _, c in RAMP]) for k in range(3)], axis=-1)
    dzdy, dzdx = np.gradient(heights * 5.0)
    shade = np.maximum((0.5 * dzdx + 0.5 * dzdy + 0.7071) / np.sqrt(dzdx**2 + dzdy**2 + 1), 0)
    rgb = np.clip(colour * ((0.55 + 0.45 * shade) * 255)[..., None], 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(out, format="PNG", compress_level=1)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--brokers", "--topic", "--model", "--bucket", "--prefix"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--tasks", type=int, required=True)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    model = session(args.model)
    s3 = boto3.client("s3")
    consumer = Consumer({"bootstrap.servers": args.brokers, "group.id": f"peer-{uuid.uuid4()}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([args.topic])
    done: list[float] = []
    while len(done) < args.tasks:
        messages = [m for m in consumer.consume(args.batch, timeout=1.0) if m.error() is None]
        if not messages:
            continue
        tasks = [t for t in map(json.loads, (m.value() for m in messages)) if is_tile(t)]
        if not tasks:
            consumer.commit(asynchronous=False)
            continue
        (denoised,) = model.run(["denoised"], inputs(tasks))
        for task, rows in zip(tasks, denoised):
            s3.put_object(Bucket=args.bucket, Key=f"{args.prefix}/{task['task_id']}.png", Body=png(rows[0]),
                          ContentType="image/png")
            done.append(time.monotonic())
        consumer.commit(asynchronous=False)
    consumer.close()
    skip = len(done) // 10
    rate = (len(done) - skip - 1) / (done[-1] - done[skip])
    print(json.dumps({"images": len(done), "images_per_s": round(rate, 3)}))


if __name__ == "__main__":
    main()
