"""Score a trace over MCP with the official MCP client, 2.0 or later (pip install 'mcp>=2')."""

import asyncio
import json
import os

from mcp import Client


async def main(trace: dict) -> None:
    url = os.environ.get("KP_URL", "http://127.0.0.1:8000") + "/mcp"
    async with Client(url) as kp:
        print([tool.name for tool in (await kp.list_tools()).tools])
        result = await kp.call_tool("kp_score_trace", {**trace, "dry_run": True})
        print(result.structured_content["score"])
        print(result.content[0].text)


with open("examples/trace.json", encoding="utf-8") as file:
    asyncio.run(main(json.load(file)))
# ['kp_score_trace', 'kp_score_traces', 'kp_check_contribution']
# 0.57625
# score 0.57625 is below the 0.75 sharing threshold; task_domain not recognised, scored with the default weights; novelty not measured (cache_empty)
