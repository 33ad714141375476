"""What guards requests before they reach the scoring: the idempotency store (a retried
request answered as the first was) and the rate limits' token buckets, each in this process or
in Redis for several replicas. The novelty memory lives apart, in app/store."""
