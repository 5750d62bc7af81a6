"""WebShop (Yao et al. 2022) as a `TextEnv`: search, browse results, open an item, choose its options, buy.

The dynamics follow `web_agent_site/envs/web_agent_text_env.py` (`step`, `SimServer.receive`):
- `search[query]` on the search page shows page 1 of the query's hits; `click[x]` needs `x` among the page's
  clickables; actions are compared lower-cased (the original lower-cases the argument too);
- results: `click[<asin>]` opens the item, `click[next >]` / `click[< prev]` page, `click[back to search]`;
- item: `click[<option value>]` chooses it in its group and stays; `click[description|features|reviews]` opens
  a sub-page whose `click[< prev]` comes back with the options kept; `click[< prev]` goes back to the results
  page it came from (forgetting the options, as the original's search results reset them);
- `click[buy now]` scores the purchase (`reward.score`) and ends the episode.
A malformed or unavailable action is a no-op; its observation is the unchanged page, as in the original and
verl-agent, so the step after it shares its anchor with the same page reached otherwise. `invalid_notice=True`
(ours, the default) puts "Invalid action: nothing happens." before the page: the model reads that its action
failed, and that step is an anchor of its own. Departure: `search[...]` works only where the page has the
search bar (the original accepts it anywhere). The reward is `win_reward` (10, as HGPO and verl-agent) when the score is
1 and 0 otherwise; `info["score"]` keeps the score.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from numbers import Integral, Real
from pathlib import Path
from typing import Any

from hgpo_trl.envs.base import Info
from hgpo_trl.envs.webshop import pages
from hgpo_trl.envs.webshop.catalogue import Goal, Product
from hgpo_trl.envs.webshop.prompt import render_prompt
from hgpo_trl.envs.webshop.reward import score
from hgpo_trl.envs.webshop.shop import load_shop
from hgpo_trl.envs.webshop.tasks import goal_from_row

INVALID = "Invalid action: nothing happens."
SEARCH_PLACEHOLDER = "search[<your query>]"
_ACTION = re.compile(r"(search|click)\s*\[([^\[\]]*)\]", re.IGNORECASE)
_EDGE = " \t\r\n'\"`,."  # what a model may wrap an action in: the prompt lists them as 'click[x]',


def parse_action(action: str) -> tuple[str, str] | None:
    """("search" | "click", argument lower-cased with spaces folded), or None when malformed or empty."""
    match = _ACTION.fullmatch(action.strip(_EDGE))
    if match is None:
        return None
    argument = " ".join(match.group(2).lower().split())
    return (match.group(1).lower(), argument) if argument else None


class WebShopEnv:
    """The shop of `(data_path, num_products, seed)` (see `shop.py`), one goal (task row) per episode.

    The observation is the page's text (`pages.py`). `info` holds `admissible_actions` ("search[<your query>]"
    where the search bar is, then "click[x]" for the page's clickables, as verl-agent lists them),
    `state_key` (the page's text, without the invalid-action notice; like the page, it does not show the
    options chosen), `won`, `task` (the instruction), `step` and `score` (0 until the purchase).
    `invalid_notice=False` shows an invalid action's page alone, as released (the paper configs).
    """

    def __init__(self, data_path: str | Path | None = None, num_products: int | None = None, seed: int = 0,
                 max_steps: int = 30, win_reward: float = 10.0, invalid_notice: bool = True):
        if not isinstance(max_steps, Integral) or isinstance(max_steps, bool) or max_steps < 1:
            raise ValueError(f"max_steps must be a positive integer, got {max_steps!r}")
        if isinstance(win_reward, bool) or not isinstance(win_reward, Real) or not math.isfinite(win_reward):
            raise ValueError(f"win_reward must be a finite number, got {win_reward!r}")
        if not isinstance(invalid_notice, bool):
            raise ValueError(f"invalid_notice must be true or false, got {invalid_notice!r}")
        self.shop = load_shop(data_path, num_products, seed)
        self.max_steps = int(max_steps)
        self.win_reward = float(win_reward)
        self.invalid_notice = invalid_notice
        self._goal: Goal | None = None

    def reset(self, task: Mapping[str, Any]) -> tuple[str, Info]:
        goal = goal_from_row(task)
        product = self.shop.by_asin.get(goal.asin)
        if product is None or product.title != goal.name:
            raise ValueError(f"webshop task {goal.asin!r} ({goal.name!r}) is not a product of this shop: "
                             f"build the tasks and the environment from the same data_path, num_products "
                             f"and seed")
        self._goal = goal
        self._steps, self._done, self._score = 0, False, 0.0
        self._show_search()
        return self._page.text, self._info()

    def step(self, action: str | None) -> tuple[str, float, bool, bool, Info]:
        if self._goal is None:
            raise RuntimeError("WebShopEnv.step() called before reset(task)")
        if self._done:
            raise RuntimeError("WebShopEnv.step() called after the episode ended; call reset(task) first")
        if action is not None and not isinstance(action, str):
            raise ValueError(f"action must be a string or None, got {type(action).__name__}")
        self._steps += 1
        parsed = parse_action(action) if action is not None else None
        valid = parsed is not None and self._act(*parsed)
        terminated = self._kind == "done"
        won = terminated and self._score == 1.0
        truncated = not terminated and self._steps >= self.max_steps
        self._done = terminated or truncated
        observation = self._page.text if valid or not self.invalid_notice else f"{INVALID} {self._page.text}"
        return observation, self.win_reward if won else 0.0, terminated, truncated, self._info()

    def _act(self, verb: str, argument: str) -> bool:
        """Carry out a parsed action; False (nothing changed) when the page does not offer it."""
        if verb == "search":
            if not self._page.has_search_bar:
                return False
            self._hits, self._page_number = self.shop.search(argument), 1
            self._show_results()
        elif argument not in self._page.clickables:
            return False
        elif argument == pages.BUY_NOW.lower():
            self._score = score(self._product, self._goal, self._product.price, self._chosen).total
            self._kind, self._page = "done", pages.done_page(self._score)
        elif argument == pages.BACK_TO_SEARCH.lower():
            self._show_search()
        elif argument == pages.NEXT_PAGE.lower():
            self._page_number += 1
            self._show_results()
        elif argument == pages.PREV_PAGE.lower():
            if self._kind == "results":
                self._page_number -= 1
            (self._show_item if self._kind in pages.SUB_PAGES else self._show_results)()
        elif argument in (name.lower() for name in pages.SUB_PAGES):
            self._kind = argument.capitalize()
            self._page = pages.sub_page(self._product, self._kind)
        elif self._kind == "results":
            self._product, self._chosen = next(p for p in self._hits if p.asin.lower() == argument), {}
            self._show_item()
        else:  # an option value: the original files it under the last group offering it
            group = [name for name, values in self._product.options.items() if argument in values][-1]
            self._chosen[group] = argument
            self._show_item()
        return True

    def _show_search(self) -> None:
        self._kind, self._page = "search", pages.search_page()
        self._hits: list[Product] = []
        self._page_number = 0
        self._product: Product | None = None
        self._chosen: dict[str, str] = {}

    def _show_results(self) -> None:
        self._kind, self._page = "results", pages.results_page(self._hits, self._page_number)
        self._product, self._chosen = None, {}

    def _show_item(self) -> None:
        self._kind, self._page = "item", pages.item_page(self._product)

    def _info(self) -> Info:
        clicks = [f"click[{c}]" for c in self._page.clickables]
        admissible = [SEARCH_PLACEHOLDER, *clicks] if self._page.has_search_bar else clicks
        return {"admissible_actions": admissible, "state_key": self._page.text, "won": self._score == 1.0,
                "task": self._goal.instruction, "step": self._steps, "score": self._score}

    @property
    def chosen_options(self) -> dict[str, str]:
        """The options chosen on the current item ({group: value}): simple text mode does not show them."""
        return dict(self._chosen)

    def render_prompt(self, task: str, history: Sequence[tuple[str, str]], observation: str,
                      admissible: Sequence[str], step: int) -> str:
        return render_prompt(task, history, observation, admissible, step)

    def close(self) -> None:
        """Nothing to release: the shop is shared."""
