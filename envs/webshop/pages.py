"""The shop's pages in WebShop's simple text mode.

The original renders HTML templates (`web_agent_site/templates/*.html`) and flattens the visible text with
" [SEP] " (`web_agent_text_env.py:convert_html_to_text(simple=True)`); its clickables are the buttons and
product links (lower-cased text) and the option values (`get_available_actions`). verl-agent then drops the
"WebShop [SEP] Instruction: [SEP] <instruction>" head (the instruction is in the prompt already) and quotes
each part (`WebshopEnvironmentManager.format_obs`): that is the text here, e.g.
"'Back to Search' [SEP] 'Page 1 (Total results: 50)' [SEP] 'Next >' [SEP] 'B09KP78G37' [SEP] ...".
The layout follows the templates of the released text environment (as in ReAct's WebShop trajectories):
"< Prev" on results (past page 1), item and sub-pages, "Next >" while more results follow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hgpo_trl.envs.webshop.catalogue import Product

PRODUCT_WINDOW = 10  # engine.py: products per results page
BACK_TO_SEARCH, NEXT_PAGE, PREV_PAGE, BUY_NOW = "Back to Search", "Next >", "< Prev", "Buy Now"
SUB_PAGES = ("Description", "Features", "Reviews")


@dataclass(frozen=True)
class Page:
    parts: tuple[str, ...]
    clickables: tuple[str, ...]  # lower-cased, in page order
    has_search_bar: bool = False

    @property
    def text(self) -> str:
        return " [SEP] ".join(f"'{part}'" for part in self.parts)


def search_page() -> Page:
    # The search button is a clickable of the original too, but clicking it does nothing: left out.
    return Page(("Search",), (), has_search_bar=True)


def results_page(hits: Sequence[Product], page: int) -> Page:
    """Page `page` (from 1) of the `hits` of a search."""
    shown = hits[(page - 1) * PRODUCT_WINDOW:page * PRODUCT_WINDOW]
    buttons = [BACK_TO_SEARCH] + [PREV_PAGE] * (page > 1) + [NEXT_PAGE] * (page * PRODUCT_WINDOW < len(hits))
    listing = [text for p in shown for text in (p.asin, p.title, p.price_tag)]
    parts = [buttons[0], f"Page {page} (Total results: {len(hits)})", *buttons[1:], *listing]
    return Page(tuple(parts), tuple(b.lower() for b in buttons) + tuple(p.asin.lower() for p in shown))


def item_page(product: Product) -> Page:
    options = [text for name, values in product.options.items() for text in (name, *values)]
    parts = [BACK_TO_SEARCH, PREV_PAGE, *options, product.title, f"Price: {product.price_tag}",
             f"Rating: {product.rating}", *SUB_PAGES, BUY_NOW]
    buttons = [BACK_TO_SEARCH, PREV_PAGE, *SUB_PAGES, BUY_NOW]
    values = dict.fromkeys(v for values in product.options.values() for v in values)
    return Page(tuple(parts), tuple(b.lower() for b in buttons) + tuple(values))


def sub_page(product: Product, name: str) -> Page:
    """The "Description", "Features" or "Reviews" page of `product`."""
    if name == "Description":
        content = [product.description or "No Description"]
    elif name == "Features":
        content = list(product.bullet_points) or ["No Features"]
    else:
        content = [text for r in product.reviews for text in (f'"{r.title}"', str(r.score), r.body)]
        content = content or ["No reviews found"]
    return Page((BACK_TO_SEARCH, PREV_PAGE, *content), (BACK_TO_SEARCH.lower(), PREV_PAGE.lower()))


def done_page(score: float) -> Page:
    return Page(("Thank you for shopping with us!", "Your score (min 0.0, max 1.0)", f"{score:.4f}"), ())
