"""One shop: the products, their search index and the goals, built once per process for each data source.

A data source is `(data_path, num_products, seed)`: the generated catalogue when `data_path` is None
(`num_products` products, 500 by default), else the original files in `data_path` (the first `num_products`
products, all by default). Every environment and task list of a source shares one `Shop` (an LRU cache), so
a batch of environments builds the index once.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path

from hgpo_trl.envs.webshop import original
from hgpo_trl.envs.webshop.catalogue import Goal, Product, generate_goals, generate_products
from hgpo_trl.envs.webshop.search import SearchIndex, product_document

DEFAULT_NUM_PRODUCTS = 500


@dataclass(frozen=True)
class Shop:
    products: tuple[Product, ...]
    by_asin: Mapping[str, Product]
    index: SearchIndex

    def search(self, query: str) -> list[Product]:
        return [self.products[i] for i in self.index.search(query)]


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def source_key(data_path: str | Path | None, num_products: int | None,
               seed: int) -> tuple[str | None, int | None, int]:
    """The checked, canonical cache key of a data source."""
    if data_path is not None and not isinstance(data_path, str | Path):
        raise ValueError(f"data_path must be a path or None, got {type(data_path).__name__}")
    if num_products is not None and (not _is_int(num_products) or num_products < 1):
        raise ValueError(f"num_products must be a positive integer or None, got {num_products!r}")
    if not _is_int(seed):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if data_path is None:
        return None, int(num_products or DEFAULT_NUM_PRODUCTS), int(seed)
    original.data_files(data_path, human_goals=False)  # fail early, naming the path and the missing file
    return str(Path(data_path).resolve()), None if num_products is None else int(num_products), int(seed)


@functools.lru_cache(maxsize=8)
def _shop(data_path: str | None, num_products: int | None, seed: int) -> Shop:
    if data_path is None:
        products = generate_products(num_products, seed)
    else:
        products = original.load_products(data_path, num_products, seed)
    if not products:
        raise ValueError(f"WebShop data_path {data_path!r} holds no usable product")
    return Shop(products, {p.asin: p for p in products}, SearchIndex([product_document(p) for p in products]))


@functools.lru_cache(maxsize=16)
def _goals(data_path: str | None, num_products: int | None, seed: int, human_goals: bool) -> tuple[Goal, ...]:
    products = _shop(data_path, num_products, seed).products
    if data_path is None:
        return generate_goals(products, seed)
    return original.load_goals(data_path, products, seed, human_goals)


def load_shop(data_path: str | Path | None = None, num_products: int | None = None, seed: int = 0) -> Shop:
    return _shop(*source_key(data_path, num_products, seed))


def load_goals(data_path: str | Path | None = None, num_products: int | None = None, seed: int = 0,
               human_goals: bool = True) -> tuple[Goal, ...]:
    """The source's goals: generated (`human_goals` does not apply), or the human or synthetic goals of the
    original files."""
    return _goals(*source_key(data_path, num_products, seed), bool(human_goals))
