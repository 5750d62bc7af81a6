"""WebShop's task lists: one dataset row per goal, and back from a row to the goal.

Splits follow the original: `SimServer` shuffles the goals with `random.seed(233)`, and WebShop's baselines
test on the first 500, validate on the next 1000 and train on the rest. A goal list too small for that
(fewer than 2000 goals: the generated catalogue, a few test products) gives a tenth to test, a tenth to
validation (one goal at least each) and the rest to training.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from numbers import Integral, Real
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hgpo_trl.envs.webshop.catalogue import Goal
from hgpo_trl.envs.webshop.shop import load_goals

if TYPE_CHECKING:  # imported where tasks are built: environment workers never load it (4 s)
    import datasets

SPLITS = ("train", "valid", "test")
GOAL_SHUFFLE_SEED = 233
ORIGINAL_TEST, ORIGINAL_VALID = 500, 1000
ORIGINAL_SPLIT_MIN_GOALS = 2000
EVAL_FRACTION = 0.1
TEXT_FIELDS = ("asin", "instruction", "query", "category", "product_category", "name")
LIST_FIELDS = ("attributes", "goal_options")
def features() -> datasets.Features:
    """The task rows' columns and types."""
    import datasets

    return datasets.Features({
        "goal_id": datasets.Value("int64"), **{name: datasets.Value("string") for name in TEXT_FIELDS},
        **{name: datasets.List(datasets.Value("string")) for name in LIST_FIELDS},
        "price_upper": datasets.Value("float64"),
    })


def goal_from_row(row: Mapping[str, Any]) -> Goal:
    """The goal of a task row (other columns are ignored); ValueError naming a missing or ill-typed field."""
    if not isinstance(row, Mapping):
        raise ValueError(f"webshop task must be a mapping (a dataset row), got {type(row).__name__}")
    for name in (*TEXT_FIELDS, *LIST_FIELDS, "price_upper"):
        if name not in row:
            raise ValueError(f"webshop task row lacks field {name!r}")
    for name in TEXT_FIELDS:
        if not isinstance(row[name], str):
            raise ValueError(f"webshop task field {name!r} must be a string, got {row[name]!r}")
    for name in LIST_FIELDS:
        if isinstance(row[name], str) or not all(isinstance(v, str) for v in row[name]):
            raise ValueError(f"webshop task field {name!r} must be a list of strings, got {row[name]!r}")
    if not isinstance(row["price_upper"], Real) or isinstance(row["price_upper"], bool):
        raise ValueError(f"webshop task field 'price_upper' must be a number, got {row['price_upper']!r}")
    return Goal(asin=row["asin"], instruction=row["instruction"], attributes=tuple(row["attributes"]),
                options=tuple(row["goal_options"]), price_upper=float(row["price_upper"]), query=row["query"],
                category=row["category"], product_category=row["product_category"], name=row["name"])


def split_ids(num_goals: int, split: str) -> list[int]:
    """The goal ids of `split`, in the shuffled order."""
    ids = list(range(num_goals))
    random.Random(GOAL_SHUFFLE_SEED).shuffle(ids)
    if num_goals >= ORIGINAL_SPLIT_MIN_GOALS:
        n_test, n_valid = ORIGINAL_TEST, ORIGINAL_VALID
    else:
        n_test = n_valid = max(1, round(num_goals * EVAL_FRACTION))
    start = {"test": 0, "valid": n_test, "train": n_test + n_valid}[split]
    stop = {"test": n_test, "valid": n_test + n_valid, "train": num_goals}[split]
    return ids[start:stop]


def webshop_tasks(split: str = "train", data_path: str | Path | None = None, num_tasks: int | None = None,
                  seed: int = 0, num_products: int | None = None,
                  human_goals: bool = True) -> datasets.Dataset:
    """The goals of `split` as rows (`goal_id` and the goal's fields), for the shop that `WebShopEnv` builds
    from the same `data_path`, `num_products` and `seed`. `num_tasks` keeps the first `num_tasks` rows,
    cycling through the split again when it asks for more."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if num_tasks is not None and (not isinstance(num_tasks, Integral) or isinstance(num_tasks, bool)
                                  or num_tasks < 1):
        raise ValueError(f"num_tasks must be a positive integer or None, got {num_tasks!r}")
    goals = load_goals(data_path, num_products, seed, human_goals)
    ids = split_ids(len(goals), split)
    if not ids:
        raise ValueError(f"the WebShop source {data_path!r} has {len(goals)} goals: "
                         f"too few for a {split!r} split")
    if num_tasks is not None:
        ids = [ids[i % len(ids)] for i in range(num_tasks)]
    schema = features()
    rows = {name: [] for name in schema}
    for goal_id in ids:
        goal = goals[goal_id]
        rows["goal_id"].append(goal_id)
        for name in TEXT_FIELDS:
            rows[name].append(getattr(goal, name))
        rows["attributes"].append(list(goal.attributes))
        rows["goal_options"].append(list(goal.options))
        rows["price_upper"].append(goal.price_upper)
    import datasets

    return datasets.Dataset.from_dict(rows, features=schema)
