"""Where the novelty memory lives: in this process, or in Redis's Query Engine for several
replicas.

Services (the evaluator, the /cache routes) use the interface in `base`, which imports no
implementation; `in_process` and `redis_vectors` implement it, and app/services/runtime.py
picks one from the settings. The domain's VectorCache (the ring and the exact scan) does the
in-process memory's arithmetic and knows nothing of threads, files or Redis.
"""
