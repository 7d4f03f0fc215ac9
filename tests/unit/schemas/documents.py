"""Feed a whole document to a backend as a model would write it: each token must be in the
mask and accepted by the matcher, and the grammar must then accept EOS."""
from __future__ import annotations

import json

import numpy as np

from backend_vocab import EOS
from grammar_contract.spec import GrammarSpec


def takes(backend, compiled, text: str, tokenize) -> bool:
    """True when `text`, tokenized by `tokenize`, passes the mask and matcher up to EOS."""
    matcher, masks = backend.new_matcher(compiled), np.zeros((1, backend.tokenizer.mask_words), np.int32)
    for token in [*tokenize(text), EOS]:
        backend.batch_fill([matcher], masks, [0])
        if not (masks[0][token >> 5] >> (token & 31)) & 1 or not backend.batch_accept([matcher], [token])[0]:
            return False
    return True


def accepts(backend, schema: dict, document, tokenize) -> bool:
    """`document` (a JSON value) in compact form under `schema` compiled by `backend`."""
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(schema)))
    return takes(backend, compiled, json.dumps(document, separators=(",", ":")), tokenize)
