"""Score a trace with the Python client (pip install ./clients/python)."""

import json

from kp_scoring import KpScoringClient, ValidationFailed

with open("examples/trace.json", encoding="utf-8") as file:
    trace = json.load(file)

# The service at KP_URL (default http://127.0.0.1:8000); a 429 or 503 is retried twice.
with KpScoringClient(retries=2) as kp:
    result = kp.evaluate(trace, dry_run=True)  # dry run: not added to the novelty memory
    print(result.score, result.weights.profile, result.overrides)
    print(result.profile)  # task_domain "code-review" names no profile: the default applied
    print(result.novelty.measured, result.novelty.reason)
    # A batch is scored in order: the second trace is compared with the first, its twin.
    batch = kp.evaluate_batch([trace, trace], dry_run=True)
    print([round(r.score, 5) for r in batch], round(batch[1].novelty.max_cosine or 0, 5))
    try:
        kp.evaluate({"@type": "ReasoningTrace"})
    except ValidationFailed as exc:
        print([e.path for e in exc.errors][:3])
# 0.57625 default ['low_tool_diversity']
# name='default' domain_recognised=False
# False cache_empty
# [0.57625, 0.40125] 1.0
# ['body.@context', 'body.id', 'body.metadata']
