"""kp-scoring: the KnowledgePulse trace scoring service."""

__version__ = "0.1.0"
