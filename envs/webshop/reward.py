"""The WebShop purchase score (Yao et al. 2022, section 3.1), as `web_agent_site/engine/goal.py:get_reward`.

    score = r_type * (attributes_matched + options_matched + r_price) / (goal_attributes + goal_options + 1)

- attributes: a goal attribute matches a product attribute with token-set similarity > 85, or appears in the
  product's title, features or description;
- options: each chosen option (colours normalised by `normalize_color`) matches a goal option exactly when the
  option is a size, with token-set similarity > 85 otherwise, or when it appears in the product's text;
- price: 1 when the price is at most the goal's upper bound;
- type: 1, 0.5, 0.1 or 0 from the query, the category path and the overlap of the titles' nouns.

Two light, deterministic stand-ins replace the original's dependencies:
- `token_set_ratio` is fuzzywuzzy's `fuzz.token_set_ratio` on its pure-Python path (difflib's ratio), where
  the original calls thefuzz, whose Levenshtein-based ratio can differ by a few points: a pair scoring near
  the 85 threshold may fall on the other side of it;
- `title_nouns` keeps the title's content words (letters only, stopwords dropped) where the original keeps
  spaCy's NOUN/PROPN tokens (en_core_web_lg): adjectives and verbs count too, so `title_score` can differ.
One departure: the original counts chosen options, not goal options, so extra options found in the product's
text can push the score above 1; here the option matches are capped at the number of goal options, keeping
the score in [0, 1].
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from hgpo_trl.envs.webshop.catalogue import Goal, Product

EXACT_MATCH_OPTIONS = ("size",)
FUZZY_THRESHOLD = 85

# web_agent_site/engine/normalize.py: an option value becomes the first of these found inside it.
COLOR_SET = (
    "alabaster", "apricot", "aqua", "ash", "asphalt", "azure", "banana", "beige", "black", "blue", "blush",
    "bordeaux", "bronze", "brown", "burgundy", "camel", "camo", "caramel", "champagne", "charcoal", "cheetah",
    "chestnut", "chocolate", "christmas", "coffee", "cognac", "copper", "coral", "cranberry", "cream",
    "crystal", "dark", "denim", "eggplant", "elephant", "espresso", "fuchsia", "gold", "granite", "grape",
    "graphite", "grass", "gray", "green", "grey", "heather", "indigo", "ivory", "ivy", "khaki", "lavender",
    "lemon", "leopard", "light", "lilac", "lime", "magenta", "maroon", "mauve", "merlot", "midnight", "mint",
    "mocha", "multicolor", "mushroom", "mustard", "natural", "navy", "nude", "olive", "orange", "peach",
    "pewter", "pink", "plum", "purple", "rainbow", "red", "rose", "royal", "rust", "sand", "sapphire",
    "seashell", "silver", "skull", "slate", "steel", "stone", "stonewash", "sunflower", "tan", "taupe",
    "teal", "tiger", "turquoise", "violet", "walnut", "wheat", "white", "wine", "yellow",
)

STOPWORDS = frozenset(
    "a about after all also an and any are as at be been but by can for from has have he her his how i if in "
    "into is it its more most my no not of off on only or our out over she so such than that the their them "
    "then there these they this those to too under up very was we were what when which while who why will "
    "with without you your".split())
_NON_WORD = re.compile(r"\W+")
_LETTERS = re.compile(r"[a-z]+")


def normalize_color(value: str) -> str:
    return next((color for color in COLOR_SET if color in value), value)


def _ratio(a: str, b: str) -> int:
    if not a or not b:
        return 0
    return round(100 * difflib.SequenceMatcher(None, a, b).ratio())


def token_set_ratio(a: str, b: str) -> int:
    """fuzzywuzzy's token_set_ratio: compare the shared words with each side's shared + own words."""
    tokens_a = set(_NON_WORD.sub(" ", a.lower()).split())
    tokens_b = set(_NON_WORD.sub(" ", b.lower()).split())
    if not tokens_a or not tokens_b:
        return 0
    shared = " ".join(sorted(tokens_a & tokens_b))
    with_a = f"{shared} {' '.join(sorted(tokens_a - tokens_b))}".strip()
    with_b = f"{shared} {' '.join(sorted(tokens_b - tokens_a))}".strip()
    return max(_ratio(shared, with_a), _ratio(shared, with_b), _ratio(with_a, with_b))


def title_nouns(title: str) -> set[str]:
    return {word for word in _LETTERS.findall(title.lower()) if len(word) > 1 and word not in STOPWORDS}


@dataclass(frozen=True)
class Score:
    """The score and its parts (the original's `verbose` info)."""

    total: float
    r_type: float
    r_att: float
    r_option: float | None
    r_price: bool
    query_match: bool
    category_match: bool
    title_score: float


def type_reward(product: Product, goal: Goal) -> tuple[float, bool, bool, float]:
    """`get_type_reward`: (r_type, query_match, category_match, title_score)."""
    query_match = product.query == goal.query
    product_path = {part.strip() for part in product.product_category.split("›")}
    goal_path = {part.strip() for part in goal.product_category.split("›")}
    category_match = len(product_path & goal_path) >= 2
    desired = title_nouns(goal.name)
    title_score = len(title_nouns(product.title) & desired) / len(desired) if desired else 0.2
    r_type = 1.0 if query_match or category_match or title_score > 0.2 else 0.5
    # The original applies these after the match test: a title without the goal's nouns overrides it.
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return r_type, query_match, category_match, title_score


def _in_text(phrase: str, product: Product) -> bool:
    return (phrase in product.title.lower() or phrase in " ".join(product.bullet_points).lower()
            or phrase in product.description.lower())


def attribute_matches(product: Product, goal: Goal) -> int:
    return sum(any(token_set_ratio(p_attr, g_attr) > FUZZY_THRESHOLD for p_attr in product.attributes)
               or _in_text(g_attr, product) for g_attr in goal.attributes)


def option_matches(product: Product, goal: Goal, chosen: dict[str, str]) -> int:
    goal_options = [normalize_color(option) for option in goal.options]
    matches = 0
    for name, value in chosen.items():
        value = normalize_color(value)
        if name.lower() in EXACT_MATCH_OPTIONS:
            matched = value in goal_options
        else:
            matched = any(token_set_ratio(option, value) > FUZZY_THRESHOLD for option in goal_options)
        matches += matched or _in_text(value, product)
    return min(matches, len(goal_options))


def score(product: Product, goal: Goal, price: float, chosen: dict[str, str]) -> Score:
    """The score of buying `product` at `price` with the `chosen` options ({option name: value})."""
    r_type, query_match, category_match, title_score = type_reward(product, goal)
    n_attributes = attribute_matches(product, goal)
    n_options = option_matches(product, goal, chosen)
    r_price = price <= goal.price_upper
    total = r_type * (n_attributes + n_options + r_price) / (len(goal.attributes) + len(goal.options) + 1)
    return Score(total=total, r_type=r_type,
                 r_att=n_attributes / len(goal.attributes) if goal.attributes else 0.0,
                 r_option=n_options / len(goal.options) if goal.options else None, r_price=r_price,
                 query_match=query_match, category_match=category_match, title_score=title_score)
