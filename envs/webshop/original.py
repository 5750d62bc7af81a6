"""The original WebShop data files, read as `web_agent_site/engine/engine.py:load_products` and
`engine/goal.py:get_human_goals` / `get_synthetic_goals` read them.

A data folder holds (names as in WebShop's `setup.sh` downloads):
- `items_shuffle*.json`: a list of scraped products (`asin`, `name`, `full_description`, `small_description`,
  `pricing` like "$12.99" or "$10.99$20.99", `customization_options` {name: [{"value": ...}]}, `query`,
  `category`, `product_category`);
- `items_ins_v2*.json`: {asin: {"attributes": [...], "instruction": ..., "instruction_attributes": [...]}};
- `items_human_ins.json` (for human goals): {asin: [{"instruction", "instruction_attributes",
  "instruction_options"}]}.
When a folder holds both the full and the `_1000` file, the full one is read (the first name in order).
Reviews (`reviews.json`) are not read, as in verl-agent's copy: ratings show "N.A.".
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hgpo_trl.envs.webshop.catalogue import Goal, Product, price_bound

PRODUCTS_GLOB = "items_shuffle*.json"
ATTRIBUTES_GLOB = "items_ins_v2*.json"
HUMAN_GOALS_FILE = "items_human_ins.json"
DEFAULT_PRICE = 100.0


def _find(folder: Path, pattern: str) -> Path:
    matches = sorted(folder.glob(pattern))
    if not matches:
        raise ValueError(f"WebShop data_path {str(folder)!r} lacks the file {pattern!r}")
    return matches[0]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read WebShop data file {str(path)!r}: {err}") from None


@contextmanager
def _format_of(path: Path) -> Iterator[None]:
    """A missing key or a wrong type in a data file becomes a ValueError naming the file."""
    try:
        yield
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        raise ValueError(f"WebShop data file {str(path)!r} is not in the original format: {err!r}") from None


def data_files(data_path: str | Path, human_goals: bool) -> tuple[Path, Path, Path | None]:
    """(products file, attributes file, human goals file or None); ValueError naming what is missing."""
    folder = Path(data_path)
    if not folder.is_dir():
        raise ValueError(f"WebShop data_path {str(folder)!r} is not an existing folder")
    human = folder / HUMAN_GOALS_FILE
    if human_goals and not human.is_file():
        raise ValueError(f"WebShop data_path {str(folder)!r} lacks the file {HUMAN_GOALS_FILE!r} "
                         f"(needed for human goals; pass human_goals=False for the synthetic ones)")
    return _find(folder, PRODUCTS_GLOB), _find(folder, ATTRIBUTES_GLOB), human if human_goals else None


def _pricing(text: str | None) -> tuple[list[float], str]:
    """engine.py: "$a" is one price, "$a$b" (or "$a to $b") a range; no pricing means $100."""
    prices = [float(re.sub(r"[^\d.]", "", part)) for part in (text or "").split("$")[1:]]
    if not prices:
        return [DEFAULT_PRICE], f"${DEFAULT_PRICE}"
    if len(prices) == 1:
        return prices, f"${prices[0]}"
    return prices[:2], f"${prices[0]} to ${prices[1]}"


def _options(customization: dict | None) -> dict[str, tuple[str, ...]]:
    return {name.lower(): tuple(v["value"].strip().replace("/", " | ").lower() for v in contents)
            for name, contents in (customization or {}).items() if contents is not None}


def load_products(data_path: str | Path, num_products: int | None, seed: int) -> tuple[Product, ...]:
    """The first `num_products` scraped products (all when None), as `load_products` keeps them: ASINs of at
    most 10 characters, first copy of each. A price range is scored at a price drawn in it with `seed`."""
    products_file, attributes_file, _ = data_files(data_path, human_goals=False)
    raw = _read_json(products_file)
    attributes = _read_json(attributes_file)
    with _format_of(products_file):
        return _products(raw[:num_products], attributes, random.Random(seed))


def _products(raw: list[dict], attributes: dict, rng: random.Random) -> tuple[Product, ...]:
    products, seen = [], set()
    for p in raw:
        asin = p["asin"]
        if asin == "nan" or len(asin) > 10 or asin in seen:
            continue
        seen.add(asin)
        pricing, price_tag = _pricing(p.get("pricing"))
        bullets = p.get("small_description") or []
        products.append(Product(
            asin=asin, title=p["name"], price=pricing[0] if len(pricing) == 1 else rng.uniform(*pricing),
            price_tag=price_tag, rating="N.A.", description=p.get("full_description") or "",
            bullet_points=tuple(bullets if isinstance(bullets, list) else [bullets]), reviews=(),
            attributes=tuple(attributes.get(asin, {}).get("attributes", ["DUMMY_ATTR"])),
            options=_options(p.get("customization_options")), query=p["query"].lower().strip(),
            category=p["category"], product_category=p["product_category"]))
    return tuple(products)


def _goal(product: Product, instruction: str, attributes: list[str], options: list[str],
          bound: tuple[float, str]) -> Goal:
    return Goal(asin=product.asin, instruction=instruction + bound[1], attributes=tuple(attributes),
                options=tuple(options), price_upper=bound[0], query=product.query, category=product.category,
                product_category=product.product_category, name=product.title)


def load_goals(data_path: str | Path, products: tuple[Product, ...], seed: int,
               human_goals: bool) -> tuple[Goal, ...]:
    """Human goals: one per crowd-sourced instruction with attributes. Synthetic goals: one per option
    combination of each product with a generated instruction ("... with color: x, and size: y")."""
    _, attributes_file, human_file = data_files(data_path, human_goals)
    rng = random.Random(seed)
    if human_file is not None:
        with _format_of(human_file):
            return _human_goals(products, _read_json(human_file), rng)
    with _format_of(attributes_file):
        return _synthetic_goals(products, _read_json(attributes_file), rng)


def _human_goals(products: tuple[Product, ...], instructions: dict, rng: random.Random) -> tuple[Goal, ...]:
    goals = []
    for product in products:
        for ins in instructions.get(product.asin, []):
            if ins["instruction_attributes"]:
                options = ins.get("instruction_options") or []
                options = list(options.values()) if isinstance(options, dict) else options
                goals.append(_goal(product, ins["instruction"].strip("."), ins["instruction_attributes"],
                                   options, price_bound(product.price, rng)))
    return tuple(goals)


def _synthetic_goals(products: tuple[Product, ...], attributes: dict, rng: random.Random) -> tuple[Goal, ...]:
    goals = []
    for product in products:
        entry = attributes.get(product.asin, {})
        if not entry.get("instruction"):
            continue
        bound = price_bound(product.price, rng)
        names = sorted(product.options)
        for values in itertools.product(*(product.options[name] for name in names)):
            text = ", and ".join(f"{name}: {value}" for name, value in zip(names, values, strict=True))
            goals.append(_goal(product, entry["instruction"] + (f" with {text}" if text else ""),
                               entry["instruction_attributes"], list(values), bound))
    return tuple(goals)

