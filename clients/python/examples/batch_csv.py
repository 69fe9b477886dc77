"""A batch job: submits one task per line of a prompts file, waits for all of them, and writes a
CSV of the results. Re-running it with the same `--batch-id` submits nothing twice (each request's
idempotency key is `<batch-id>-<line>`), so a job that crashed halfway is simply run again.

    SLUICE_URL=... SLUICE_API_KEY=... python batch_csv.py prompts.txt results.csv \\
        --model sd-tiny --batch-id nightly-2026-11-26
"""

from __future__ import annotations

import argparse
import csv
import sys
from concurrent.futures import ThreadPoolExecutor

import sluice


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompts", help="a text file, one prompt per line")
    parser.add_argument("out", help="the CSV to write")
    parser.add_argument("--model", default="sd-tiny")
    parser.add_argument("--batch-id", required=True, help="names this batch's idempotency keys")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for each task")
    args = parser.parse_args(argv)

    with open(args.prompts, encoding="utf-8") as f:
        prompts = [line.strip() for line in f if line.strip()]
    requests = [
        {"model": args.model, "prompt": p, "width": args.size, "height": args.size, "steps": args.steps, "seed": i}
        for i, p in enumerate(prompts)
    ]

    def progress(p: sluice.BatchProgress) -> None:
        if p.done % 100 == 0 or p.done == p.total:
            print(f"submitted {p.done}/{p.total} ({p.failed} refused)", file=sys.stderr)

    with sluice.Client() as client:
        submitted = client.submit_many(requests, concurrency=16, key_prefix=args.batch_id, on_progress=progress)

        def outcome(item: sluice.Task | sluice.APIError) -> list[str]:
            if isinstance(item, sluice.APIError):
                return ["", "refused", item.code, "", ""]
            try:
                status = item.wait(timeout=args.timeout)
            except sluice.WaitTimeout:
                return [item.id, "timeout", "", "", ""]
            error = status["error"]
            urls = " ".join(o["url"] for o in status["outputs"])
            total = str(status["timings"]["total_ms"]) if status["timings"] else ""
            return [item.id, status["status"], error["reason"] if error else "", total, urls]

        with ThreadPoolExecutor(max_workers=16) as pool:
            rows = list(pool.map(outcome, submitted))

    with open(args.out, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["line", "prompt", "task_id", "status", "reason", "total_ms", "image_urls"])
        for i, (prompt, row) in enumerate(zip(prompts, rows)):
            writer.writerow([i, prompt, *row])
    succeeded = sum(row[1] == "succeeded" for row in rows)
    print(f"{succeeded}/{len(rows)} succeeded; results in {args.out}", file=sys.stderr)
    return 0 if succeeded == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
