"""Where the novelty memory lives: in this process, or shared by replicas through Redis.

The shape follows the KnowledgePulse registry's `store/` (an interface, an in-memory and a
Redis implementation, chosen by configuration), so that readers of either find the same parts.
Layering: services (the evaluator) use the interface in `base`; the domain's VectorCache (the
ring and the exact scan) does the vector arithmetic for both implementations and knows nothing
of threads, files or Redis; `indexed_memory` adds the approximate index of a large memory and
the threads that build, feed and check it.
"""
