"""The contribution gate: the trace as the reference SDK's capture step would send it, and what
it would leak. Pure: text in, findings out."""
