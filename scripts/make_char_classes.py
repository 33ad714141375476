"""Writes app/embedding/assets/js_bert_char_classes.json from this Python's Unicode database.

    python scripts/make_char_classes.py

Run it when the Python in use has a Unicode version the file was not made for (the normaliser
then computes the classes at start, which costs about 0.2 s; tests/test_embedder.py says so).
"""

from __future__ import annotations

import json
import unicodedata

from app.embedding.js_bert_normalizer import CHAR_CLASSES_PATH, compute_char_classes

if __name__ == "__main__":
    classes = compute_char_classes()
    document = {"unicode_version": unicodedata.unidata_version, **classes}
    CHAR_CLASSES_PATH.write_text(json.dumps(document, separators=(",", ":")) + "\n")
    print(f"wrote {CHAR_CLASSES_PATH} (Unicode {unicodedata.unidata_version})")
