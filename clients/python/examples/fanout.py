"""asyncio fan-out: one prompt in several variations (seeds), submitted and awaited concurrently,
the images saved as they arrive.

    SLUICE_URL=... SLUICE_API_KEY=... python fanout.py "a lighthouse at dusk" --variations 8
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from sluice.aio import AsyncClient, AsyncTask


async def variation(task: AsyncTask, out: Path) -> tuple[str, float]:
    started = time.monotonic()
    images = await task.images(timeout=600)
    for image in images:
        image.save(out / f"{task.id}-{image.index}.png")
    return task.id, time.monotonic() - started


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("prompt")
    parser.add_argument("--model", default="sd-tiny")
    parser.add_argument("--variations", type=int, default=8)
    parser.add_argument("--out", default="fanout")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    async with AsyncClient() as client:
        tasks = await asyncio.gather(
            *(client.submit(args.model, args.prompt, width=64, height=64, steps=4, seed=s) for s in range(args.variations))
        )
        for done in asyncio.as_completed([variation(t, out) for t in tasks]):
            task_id, seconds = await done
            print(f"{task_id}: {seconds:.1f} s", file=sys.stderr)
    print(f"{len(tasks)} variations in {out}/", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
