"""What guards requests before they reach the scoring: API keys and their scopes, the rate
limits' token buckets and the idempotency records (a retried request answered as the first
was), each in this process or in Redis for several replicas."""
