"""The request pipeline: pure ASGI pieces (no BaseHTTPMiddleware, they sit on every request's
path), each doing one thing, in the order a request meets them (`pipeline.guarded`)."""
