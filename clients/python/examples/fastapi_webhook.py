"""A webhook receiver: verifies each delivery's signature, drops repeats by `webhook-id`, and
appends each task status it accepts to a JSON-lines file.

    SLUICE_WEBHOOK_SECRETS=whsec_... uvicorn fastapi_webhook:app --port 8000

`SLUICE_WEBHOOK_SECRETS`: the tenant's secrets, comma-separated (all are accepted while they
rotate). `WEBHOOK_LOG`: where accepted statuses go (default `webhooks.jsonl`). A real receiver
would keep the seen ids in its database, in the same transaction as its own effect.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict

from fastapi import FastAPI, HTTPException, Request, Response

from sluice.webhooks import verify
from sluice.errors import WebhookVerificationError

SECRETS = [s for s in os.environ.get("SLUICE_WEBHOOK_SECRETS", "").split(",") if s]
LOG = os.environ.get("WEBHOOK_LOG", "webhooks.jsonl")
SEEN: OrderedDict[str, None] = OrderedDict()  # the last 10,000 delivery ids

app = FastAPI()


@app.post("/hook", status_code=204)
async def hook(request: Request) -> Response:
    body = await request.body()  # the raw bytes: the signature covers them exactly
    try:
        status = verify(dict(request.headers), body, SECRETS)
    except WebhookVerificationError as e:
        raise HTTPException(status_code=400, detail=str(e)) from e
    delivery = request.headers["webhook-id"]
    if delivery not in SEEN:
        SEEN[delivery] = None
        if len(SEEN) > 10_000:
            SEEN.popitem(last=False)
        with open(LOG, "a", encoding="utf-8") as log:
            log.write(json.dumps({"webhook_id": delivery, "task": status}) + "\n")
    return Response(status_code=204)
