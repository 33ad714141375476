"""kp-scoring: the KnowledgePulse trace scoring service (its version: app.core.version)."""
