"""Score traces concurrently with the asynchronous client."""

import asyncio
import json

from kp_scoring import AsyncKpScoringClient


async def main(trace: dict) -> None:
    traces = [{**trace, "id": f"kp:trace:example-{i}"} for i in range(3)]
    async with AsyncKpScoringClient() as kp:
        results = await asyncio.gather(*(kp.evaluate(t, dry_run=True) for t in traces))
    for r in results:
        print(r.trace_id, r.score)


with open("examples/trace.json", encoding="utf-8") as file:
    asyncio.run(main(json.load(file)))
# kp:trace:example-0 0.57625
# kp:trace:example-1 0.57625
# kp:trace:example-2 0.57625
