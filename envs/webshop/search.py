"""The search engine: BM25 over each product's text, as WebShop's Lucene index (pyserini) ranks it.

Followed from the original: the indexed text (`search_engine/convert_product_file_format.py`: title,
description, first feature line and the option values, lower-cased), the top 50 hits per query
(`engine.py:SEARCH_RETURN_N`), only products sharing a term with the query (Lucene returns no zero-score
hits), and pyserini's default BM25 parameters k1=0.9, b=0.4 with English stopwords and stemming (Lucene's
Porter stemmer; here Snowball English, via PyStemmer). bm25s does the scoring; ties keep catalogue order.
"""

from __future__ import annotations

from collections.abc import Sequence

import bm25s
import numpy as np
import Stemmer

from hgpo_trl.envs.webshop.catalogue import Product

SEARCH_RETURN_N = 50
K1, B = 0.9, 0.4


def product_document(product: Product) -> str:
    options = ", and ".join(f"{name}: {', '.join(values)}" for name, values in product.options.items())
    return " ".join([product.title, product.description, *product.bullet_points[:1], options]).lower()


class SearchIndex:
    """BM25 over `documents`; `search` answers positions in that sequence, best first."""

    def __init__(self, documents: Sequence[str]):
        if not documents:
            raise ValueError("the search index needs at least one document")
        self._stemmer = Stemmer.Stemmer("english")
        self._bm25 = bm25s.BM25(k1=K1, b=B)
        self._bm25.index(self._tokenize(list(documents)), show_progress=False)
        self._size = len(documents)

    def _tokenize(self, texts: list[str], **kwargs):
        return bm25s.tokenize(texts, stopwords="en", stemmer=self._stemmer, show_progress=False, **kwargs)

    def scores(self, query: str) -> np.ndarray:
        tokens = self._tokenize([query], return_ids=False)[0]
        return self._bm25.get_scores(tokens) if tokens else np.zeros(self._size, dtype=np.float32)

    def search(self, query: str, k: int = SEARCH_RETURN_N) -> list[int]:
        scores = self.scores(query)
        order = np.lexsort((np.arange(self._size), -scores))[:k]
        return [int(i) for i in order if scores[i] > 0]
