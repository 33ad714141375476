"""The novelty memory: the ring of vectors and its exact scan (`ring`), the interface the
service uses (`base`), and its implementations: in this process, kept in SQLite
(`in_process`, `sqlite`), or shared by replicas in Redis's Query Engine (`redis_vectors`).
app/service/runtime.py picks one from the settings."""
