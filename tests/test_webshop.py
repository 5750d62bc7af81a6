"""The WebShop environment: pages and navigation, invalid actions, truncation, the purchase score by hand,
search ranking, determinism, the original data format, task lists, prompt, registry."""

import itertools
import json
from functools import partial

import numpy as np
import pytest

from hgpo_trl.advantages.hgpo import hgpo_peer_levels
from hgpo_trl.envs import make_env, make_tasks, registered_envs
from hgpo_trl.envs.pool import InProcessEnvs
from hgpo_trl.envs.webshop import WebShopEnv, webshop_tasks
from hgpo_trl.envs.webshop.catalogue import TYPES, Goal, Product, generate_goals, generate_products
from hgpo_trl.envs.webshop.env import INVALID, parse_action
from hgpo_trl.envs.webshop.reward import normalize_color, score, token_set_ratio, type_reward
from hgpo_trl.envs.webshop.search import product_document
from hgpo_trl.envs.webshop.shop import load_goals, load_shop
from hgpo_trl.envs.webshop.tasks import SPLITS
from hgpo_trl.rollout.lockstep import Completion, RolloutSettings, run_rollout

SHOES = "Clothing, Shoes & Jewelry › Men › Shoes › Athletic › Running"


def raw_product(asin, name, pricing, options=None, query="men's running shoes", path=SHOES, description="",
                bullets=()):
    """A product as items_shuffle.json holds it."""
    return {"asin": asin, "name": name, "full_description": description, "small_description": list(bullets),
            "pricing": pricing, "customization_options": options, "query": query, "category": "fashion",
            "product_category": path, "images": [""]}


def options(colors, sizes):
    """customization_options as items_shuffle.json holds them."""
    return {"Color": [{"value": c} for c in colors], "Size": [{"value": s} for s in sizes]}


MUGS = "Home & Kitchen › Kitchen & Dining › Dining & Entertaining › Cups, Mugs & Saucers › Mugs"
RAW_PRODUCTS = [
    raw_product("B000000001", "Acme Running Shoes for Men, Lightweight Breathable", "$45.99",
                options(["Black", "Blue"], ["9", "10"]),
                description="Breathable mesh upper on a cushioned sole.",
                bullets=["Lightweight build", "Non slip outsole"]),
    raw_product("B000000002", "Bolt Running Shoes for Men, Lightweight", "$39.99",
                options(["Black", "White"], ["9", "10"]),
                description="A cushioned sole for daily runs.", bullets=["Lightweight build"]),
    raw_product("B000000003", "Crest Running Shoes for Men, Lightweight Non Slip", "$89.99",
                options(["Black"], ["10"])),
    raw_product("B000000004", "Zen Ceramic Coffee Mug", "$12.00", query="coffee mug", path=MUGS),
    raw_product("B000000005", "Wool Hiking Socks for Men", "$10.00 to $20.00", query="Hiking Socks ",
                path="Sports & Outdoors › Outdoor Recreation › Hiking › Socks"),
    raw_product("B000000001", "A second copy of the first product", "$1.00"),
    raw_product("nan", "No ASIN", "$1.00"),
    raw_product("B0000000001234", "An ASIN too long", "$1.00"),
]
ATTRIBUTES = {  # items_ins_v2.json; B000000003 has no entry (its attributes are in its title)
    "B000000001": {"attributes": ["lightweight", "non slip"],
                   "instruction": "i want lightweight running shoes",
                   "instruction_attributes": ["lightweight"]},
    "B000000002": {"attributes": ["lightweight"]},
    "B000000004": {"attributes": ["dishwasher safe"]},
    "B000000005": {"attributes": ["lightweight"]},
}
HUMAN = {  # items_human_ins.json
    "B000000001": [{"instruction": "i need lightweight and non slip running shoes for men in black, size 10.",
                    "instruction_attributes": ["lightweight", "non slip"],
                    "instruction_options": ["black", "10"]},
                   {"instruction": "shoes", "instruction_attributes": [], "instruction_options": []}],
    "B000000004": [{"instruction": "i want a dishwasher safe coffee mug",
                    "instruction_attributes": ["dishwasher safe"], "instruction_options": []}],
    "B000000005": [{"instruction": "i need lightweight wool socks", "instruction_attributes": ["lightweight"],
                    "instruction_options": {"size": "large"}}],
}


def write_data(folder, products=RAW_PRODUCTS, attributes=ATTRIBUTES, human=HUMAN):
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in (("items_shuffle_1000.json", products), ("items_ins_v2_1000.json", attributes),
                       ("items_human_ins.json", human)):
        (folder / name).write_text(json.dumps(data), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("webshop"))


def all_rows(**kwargs):
    return [row for split in SPLITS for row in webshop_tasks(split, **kwargs)]


def goal_row(data_path, asin):
    return next(row for row in all_rows(data_path=data_path) if row["asin"] == asin)


def step(env, action):
    """Step and check that the action was accepted."""
    obs, reward, terminated, truncated, info = env.step(action)
    assert not obs.startswith(INVALID), f"{action!r} was refused on: {obs}"
    return obs, reward, terminated, truncated, info


def buy(env, row, asin, chosen):
    """Reset on `row`, find `asin` by its name, click the `chosen` option values, buy: the last step's result."""
    env.reset(row)
    step(env, f"search[{env.shop.by_asin[asin].title}]")
    step(env, f"click[{asin.lower()}]")
    for value in chosen:
        step(env, f"click[{value}]")
    return step(env, "click[buy now]")


# --- the original data format and the score by hand ------------------------------------------------------

def test_original_files_load_as_webshop_loads_them(data_path):
    shop = load_shop(data_path)
    # The second copy of B000000001 and the ASINs "nan" and too long are dropped.
    assert [p.asin for p in shop.products] == [f"B00000000{i}" for i in range(1, 6)]
    shoes, _, crest, mug, socks = shop.products
    assert shoes.options == {"color": ("black", "blue"), "size": ("9", "10")}
    assert (shoes.price, shoes.price_tag, shoes.rating) == (45.99, "$45.99", "N.A.")
    assert shoes.bullet_points == ("Lightweight build", "Non slip outsole")
    assert crest.attributes == ("DUMMY_ATTR",) and mug.attributes == ("dishwasher safe",)
    assert socks.price_tag == "$10.0 to $20.0" and 10.0 <= socks.price <= 20.0
    assert socks.query == "hiking socks"


def test_human_and_synthetic_goals(data_path):
    human = load_goals(data_path)
    assert [g.asin for g in human] == ["B000000001", "B000000004", "B000000005"]  # no-attribute goal skipped
    shoes = human[0]
    assert shoes.attributes == ("lightweight", "non slip") and shoes.options == ("black", "10")
    # The bound: the larger of two of the four round tens above $45.99.
    assert shoes.price_upper in (60.0, 70.0, 80.0)
    assert shoes.instruction == ("i need lightweight and non slip running shoes for men in black, size 10"
                                 f", and price lower than {shoes.price_upper:.2f} dollars")
    assert human[2].options == ("large",)  # instruction_options given as a dict
    synthetic = load_goals(data_path, human_goals=False)
    assert [g.options for g in synthetic] == [("black", "9"), ("black", "10"), ("blue", "9"), ("blue", "10")]
    assert synthetic[1].instruction.startswith(
        "i want lightweight running shoes with color: black, and size: 10, and price lower than")
    assert len(all_rows(data_path=data_path)) == 3
    assert len(all_rows(data_path=data_path, human_goals=False)) == 4


# Goal: attributes (lightweight, non slip), options (black, 10), price <= 60/70/80: 2 + 2 + 1 = 5 parts.
@pytest.mark.parametrize(("asin", "chosen", "expected"), [
    ("B000000001", ["black", "10"], 5 / 5),           # the perfect purchase
    ("B000000001", ["blue", "10"], (2 + 1 + 1) / 5),  # wrong colour
    ("B000000001", ["black", "9"], (2 + 1 + 1) / 5),  # wrong size (sizes match exactly)
    ("B000000001", [], (2 + 0 + 1) / 5),              # no option chosen
    ("B000000002", ["black", "10"], (1 + 2 + 1) / 5),  # lacks "non slip"
    ("B000000003", ["black", "10"], (2 + 2 + 0) / 5),  # $89.99 is over the bound; attributes in its title
    ("B000000004", [], 0.0),                          # a mug: no noun of the goal's title, r_type 0
    # Socks: other query and category; title nouns share "men" only: 1/6 -> r_type 0.5; lightweight, price ok.
    ("B000000005", [], 0.5 * (1 + 0 + 1) / 5),
])
def test_score_by_hand(data_path, asin, chosen, expected):
    env = WebShopEnv(data_path=data_path)
    obs, reward, terminated, truncated, info = buy(env, goal_row(data_path, "B000000001"), asin, chosen)
    assert info["score"] == pytest.approx(expected)
    assert (terminated, truncated, info["won"]) == (True, False, expected == 1.0)
    assert reward == (10.0 if expected == 1.0 else 0.0)
    thanks = "'Thank you for shopping with us!' [SEP] 'Your score (min 0.0, max 1.0)'"
    assert obs == f"{thanks} [SEP] '{expected:.4f}'"
    assert info["admissible_actions"] == []
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("click[back to search]")


def test_type_reward_levels():
    """r_type: 1 on a query, category (2 shared levels) or title (> 0.2 of the goal's nouns) match; 0.5
    without; then a title overlap under 0.1 gives 0.1, and none at all 0, whatever matched."""
    def product(title, query="other", path="X › Y"):
        return Product(asin="B", title=title, price=1.0, price_tag="$1.0", rating="N.A.", description="",
                       bullet_points=(), reviews=(), attributes=(), options={}, query=query, category="",
                       product_category=path)

    name = "red running shoes for men, light breathable"  # six nouns (approximated)
    six = Goal("A", "", ("x",), (), 100.0, "q", "c", "A › B › C", name)
    assert type_reward(product("running shoes"), six) == (1.0, False, False, 2 / 6)
    assert type_reward(product("shoes"), six) == (0.5, False, False, 1 / 6)
    assert type_reward(product("shoes", query="q"), six)[:2] == (1.0, True)
    assert type_reward(product("shoes", path="A › B › Z"), six)[:3] == (1.0, False, True)
    assert type_reward(product("boots", query="q", path="A › B"), six)[0] == 0.0
    words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo"
    eleven = Goal("A", "", ("x",), (), 100.0, "q", "c", "A", words)
    assert type_reward(product("alpha", query="q"), eleven) == (0.1, True, False, 1 / 11)


def test_fuzzy_matching_and_colour_normalisation():
    # fuzzywuzzy's documented examples and WebShop's normalize_color tests.
    assert token_set_ratio("fuzzy was a bear", "fuzzy fuzzy was a bear") == 100
    assert token_set_ratio("black", "jet black") == 100 and token_set_ratio("black", "blue") < 85
    assert token_set_ratio("non slip", "Non-Slip") == 100 and token_set_ratio("", "x") == 0
    cases = [("", ""), ("black forest", "black"), ("violet lavender", "lavender"),
             ("steelivy fuchsia", "fuchsia"), ("123alabaster", "alabaster"), ("webshop", "webshop")]
    assert [normalize_color(value) for value, _ in cases] == [expected for _, expected in cases]


# --- pages and navigation ---------------------------------------------------------------------------------

def test_search_page_offers_only_search(data_path):
    env = WebShopEnv(data_path=data_path)
    row = goal_row(data_path, "B000000001")
    obs, info = env.reset(row)
    assert obs == "'Search'" and info["state_key"] == obs
    assert info["admissible_actions"] == ["search[<your query>]"]
    assert info["task"] == row["instruction"]
    assert (info["step"], info["won"], info["score"]) == (0, False, 0.0)


def test_item_page_options_and_sub_pages(data_path):
    env = WebShopEnv(data_path=data_path)
    env.reset(goal_row(data_path, "B000000001"))
    step(env, "search[acme running shoes]")
    item, *_, info = step(env, "click[B000000001]")  # ASINs compare lower-cased
    assert item == ("'Back to Search' [SEP] '< Prev' [SEP] 'color' [SEP] 'black' [SEP] 'blue' [SEP] "
                    "'size' [SEP] '9' [SEP] '10' [SEP] 'Acme Running Shoes for Men, Lightweight Breathable' "
                    "[SEP] 'Price: $45.99' [SEP] 'Rating: N.A.' [SEP] 'Description' [SEP] 'Features' [SEP] "
                    "'Reviews' [SEP] 'Buy Now'")
    assert info["admissible_actions"] == [
        "click[back to search]", "click[< prev]", "click[description]", "click[features]", "click[reviews]",
        "click[buy now]", "click[black]", "click[blue]", "click[9]", "click[10]"]
    # Choosing an option stays on the page, which (simple text mode) does not show the choice.
    assert step(env, "click[blue]")[0] == item and step(env, "click[black]")[0] == item
    assert env.chosen_options == {"color": "black"}
    sub_pages = {
        "description": "'Breathable mesh upper on a cushioned sole.'",
        "features": "'Lightweight build' [SEP] 'Non slip outsole'",
        "reviews": "'No reviews found'",
    }
    for name, content in sub_pages.items():
        obs, *_, info = step(env, f"click[{name}]")
        assert obs == f"'Back to Search' [SEP] '< Prev' [SEP] {content}"
        assert info["admissible_actions"] == ["click[back to search]", "click[< prev]"]
        assert step(env, "click[< prev]")[0] == item and env.chosen_options == {"color": "black"}
    step(env, "click[features]")
    assert step(env, "click[back to search]")[0] == "'Search'" and env.chosen_options == {}


def test_generated_reviews_page():
    env = WebShopEnv()
    product = next(p for p in env.shop.products if p.reviews)
    env.reset(next(r for r in all_rows() if r["asin"] == product.asin))
    step(env, f"search[{product.title}]")
    step(env, f"click[{product.asin}]")
    review = product.reviews[0]
    shown = f"'\"{review.title}\"' [SEP] '{review.score}' [SEP] '{review.body}'"
    assert step(env, "click[reviews]")[0].startswith(f"'Back to Search' [SEP] '< Prev' [SEP] {shown}")


def test_results_paging():
    env = WebShopEnv()
    env.reset(all_rows()[0])
    listings, asins = [], []
    obs, *_, info = step(env, "search[coffee]")
    for page in range(1, 6):  # 50 hits (the cap): 5 pages of 10
        assert obs.startswith(f"'Back to Search' [SEP] 'Page {page} (Total results: 50)'")
        clicks = info["admissible_actions"]
        assert ("click[< prev]" in clicks) == (page > 1) and ("click[next >]" in clicks) == (page < 5)
        shown = [a for a in clicks if a.startswith("click[b0")]
        assert len(shown) == 10 and all(a[6:-1].upper() in obs for a in shown)
        listings.append(obs)
        asins += shown
        if page < 5:
            obs, *_, info = step(env, "click[next >]")
    assert len(set(asins)) == 50
    assert step(env, "click[< prev]")[0] == listings[3]
    # From an item, "< prev" returns to the results page it was opened from.
    step(env, asins[35])
    assert step(env, "click[< prev]")[0] == listings[3]


def test_result_count_below_the_cap():
    env = WebShopEnv()
    shop = env.shop
    expected = [p for p in shop.products if "auburn" in product_document(p)]
    assert 0 < len(expected) < 50
    env.reset(all_rows()[0])
    obs, *_, info = step(env, "search[auburn]")
    assert f"(Total results: {len(expected)})" in obs
    shown = [a[6:-1].upper() for a in info["admissible_actions"] if a.startswith("click[b0")]
    assert set(shown) <= {p.asin for p in expected} and len(shown) == min(10, len(expected))


# --- invalid actions and truncation -----------------------------------------------------------------------

BAD_ACTIONS = [None, "", "search[]", "search[   ]", "click[]", "click[nothing here]", "buy now", "jump[x]",
               "click[search]", "click [ b0000 ]", "search[shoes] click[buy now]"]
# (actions the page does not offer, the move to the next page); "<last>": the last product listed.
WALK = [
    (["click[buy now]", "click[< prev]", "click[next >]"], "search[coffee]"),
    (["search[coffee]", "click[< prev]", "click[buy now]", "click[reviews]"], "click[next >]"),
    (["search[coffee]", "click[buy now]", "click[features]"], "<last>"),
    (["search[coffee]", "click[next >]"], "click[features]"),
    (["search[coffee]", "click[buy now]", "click[features]", "click[reviews]"], "click[< prev]"),
]


@pytest.mark.parametrize("notice", [True, False])
def test_invalid_actions_are_no_ops(notice):
    env = WebShopEnv(max_steps=100, invalid_notice=notice)
    info = env.reset(all_rows()[0])[1]
    for unavailable, move in WALK:
        page, admissible, steps = info["state_key"], info["admissible_actions"], info["step"]
        for n, action in enumerate(BAD_ACTIONS + unavailable, 1):
            obs, reward, terminated, truncated, after = env.step(action)
            assert obs == (f"{INVALID} {page}" if notice else page)  # released: the page alone
            assert (reward, terminated, truncated) == (0.0, False, False)
            assert after["state_key"] == page and after["admissible_actions"] == admissible
            assert after["step"] == steps + n
        info = step(env, admissible[-1] if move == "<last>" else move)[4]  # the walk goes on from there


@pytest.mark.parametrize("notice", [True, False])
def test_the_step_after_an_invalid_one_groups_with_the_same_page_as_released(notice):
    """Two rollouts of one goal search alike; then the first sends an action the results page does not offer,
    the second goes back to search. Released (no notice), the first rollout's next anchor is the results page
    it stayed on: it shares HGPO's level 0 (GiGPO's anchor group) with both steps that saw that page, and the
    memory shows the page alone; with the notice it is a state of its own."""
    task = make_tasks("webshop", "train", num_tasks=1)[0]
    plans = [["search[shoes]"] * 2, ["click[nothing here]", "click[back to search]"],
             ["click[back to search]", "search[shoes]"], ["search[shoes]", "click[back to search]"]]
    prompts = []

    def policy(texts, infos):
        prompts.append(texts)
        return [Completion(action) for action in plans[len(prompts) - 1]]

    envs = InProcessEnvs(partial(make_env, "webshop", invalid_notice=notice), 2)
    rollout = run_rollout(envs, [task], 2, policy, RolloutSettings(action_mode="plain", max_steps=4), scripted=True)
    batch = rollout.step_batch()
    row = {(r.traj, r.step): i for i, r in enumerate(rollout.steps)}
    results = batch.obs[row[0, 1]]
    assert batch.obs[row[1, 1]] == results and not rollout.steps[row[0, 1]].observation.startswith(INVALID)
    assert (batch.obs[row[0, 2]] == results) is not notice
    assert hgpo_peer_levels(batch, depth=2)[row[0, 2], 0] is np.bool_(not notice)
    # The memory shows the page the step saw (at step 4: the pairs of steps 2 and 3).
    assert (f"[Observation 3: '{results}', Action 3: 'click[back to search]']" in prompts[3][0]) is not notice
    # The search page lists one placeholder, 'search[<your query>]': a query written there is a choice.
    assert not any(r.forced for r in rollout.steps)


def test_parse_action_is_lenient_on_wrapping_only():
    assert parse_action("  'Click[ Buy  Now ]', ") == ("click", "buy now")
    assert parse_action("SEARCH[Men's Shoes]") == ("search", "men's shoes")
    assert parse_action("search[]") is None and parse_action("click buy now") is None
    assert parse_action("think: click[buy now]") is None


def test_truncation_at_30_steps():
    env = WebShopEnv()
    row = all_rows()[0]
    env.reset(row)
    results = [env.step("click[nothing]") for _ in range(30)]
    assert [r[3] for r in results] == [False] * 29 + [True]
    assert not any(r[2] for r in results) and results[-1][4]["step"] == 30
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("search[x]")
    # Buying on the last step terminates: it is not truncation.
    env = WebShopEnv(max_steps=3)
    assert buy(env, row, row["asin"], [])[2:4] == (True, False)


# --- the generated catalogue ------------------------------------------------------------------------------

def test_every_generated_goal_can_be_bought_perfectly():
    env = WebShopEnv()
    for row in webshop_tasks("test"):
        _, reward, _, _, info = buy(env, row, row["asin"], row["goal_options"])
        assert (reward, info["won"], info["score"]) == (10.0, True, 1.0)


def test_generated_goals_have_partial_matches():
    """Other products of the goal's type score in (0, 1) when bought with the goal's options."""
    shop, goals = load_shop(), load_goals()
    for goal in goals[:50]:
        product = shop.by_asin[goal.asin]
        others = [p for p in shop.products if p.query == goal.query and p is not product]
        chosen = [dict(zip(p.options, goal.options, strict=True)) for p in others]
        partial = [p for p, c in zip(others, chosen, strict=True) if 0 < score(p, goal, p.price, c).total < 1]
        assert len(partial) >= 3


def test_generated_text_names_no_stray_attribute_or_option():
    """The score finds attributes and options in a product's text: only its own attributes may be there."""
    for product in load_shop().products:
        text = " ".join([product.title, product.description, *product.bullet_points]).lower()
        pool = next(t for t in TYPES if t.query == product.query).attributes
        assert not [a for a in pool if a in text and a not in product.attributes]
        assert not [v for values in product.options.values() for v in values if normalize_color(v) in text]
    for ptype in TYPES:  # distinct attributes and (fuzzy-matched) options never match each other
        assert all(token_set_ratio(a, b) <= 85 for a, b in itertools.combinations(ptype.attributes, 2))
        for name, values in ptype.options:
            if name != "size":
                assert all(token_set_ratio(a, b) <= 85 for a, b in itertools.combinations(values, 2))


def test_determinism():
    assert generate_products(500, 0) == generate_products(500, 0)
    assert generate_products(500, 0) != generate_products(500, 1)
    products = generate_products(500, 0)
    assert len({p.asin for p in products}) == 500 and len({p.query for p in products}) == len(TYPES)
    assert generate_goals(products, 0) == generate_goals(products, 0)
    assert webshop_tasks("train").to_list() == webshop_tasks("train").to_list()
    pages = []
    for _ in range(2):
        env, row = WebShopEnv(), webshop_tasks("valid")[3]
        pages.append([env.reset(row)[0], *(env.step(a)[0] for a in ("search[coffee]", "click[next >]"))])
    assert pages[0] == pages[1]


# --- search -----------------------------------------------------------------------------------------------

def test_exact_name_ranks_the_product_first(data_path):
    shop = load_shop(data_path)
    for product in shop.products:
        assert shop.search(product.title)[0] is product
    generated = load_shop()
    for product in generated.products:  # near-twins (same words in another order) may come first
        assert product in generated.search(product.title)[:3]


def test_hits_are_ordered_by_bm25_score():
    shop = load_shop()
    for query in ("running shoes black", "coffee", "lightweight laptop backlit keyboard", "zzz"):
        scores = shop.index.scores(query)
        hits = shop.index.search(query)
        assert [scores[i] for i in hits] == sorted((scores[i] for i in hits), reverse=True)
        assert len(hits) == min(50, int((scores > 0).sum()))
    assert shop.search("the and of") == []


# --- tasks, errors, prompt, registry ----------------------------------------------------------------------

def test_task_splits():
    splits = {split: webshop_tasks(split) for split in SPLITS}
    assert [len(splits[s]) for s in SPLITS] == [400, 50, 50]
    ids = [set(splits[s]["goal_id"]) for s in SPLITS]
    assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])
    assert len(webshop_tasks("test", num_tasks=120)) == 120
    assert webshop_tasks("test", num_tasks=51)[50] == splits["test"][0]


@pytest.mark.parametrize(("missing", "match"), [
    ("items_shuffle_1000.json", "lacks the file 'items_shuffle\\*.json'"),
    ("items_ins_v2_1000.json", "lacks the file 'items_ins_v2\\*.json'"),
    ("items_human_ins.json", "lacks the file 'items_human_ins.json'"),
])
def test_data_path_errors(tmp_path, missing, match):
    folder = write_data(tmp_path / "data")
    (folder / missing).unlink()
    with pytest.raises(ValueError, match=match) as err:
        webshop_tasks("train", data_path=folder)
    assert str(folder) in str(err.value)
    with pytest.raises(ValueError, match="not an existing folder"):
        WebShopEnv(data_path=tmp_path / "nowhere")
    bad = write_data(tmp_path / "bad", products=[{"asin": "B1"}])
    with pytest.raises(ValueError, match="not in the original format"):
        WebShopEnv(data_path=bad)


def test_reset_checks_the_task_row(data_path):
    env = WebShopEnv()
    row = all_rows()[0]
    with pytest.raises(ValueError, match="lacks field 'goal_options'"):
        env.reset({k: v for k, v in row.items() if k != "goal_options"})
    with pytest.raises(ValueError, match="must be a list of strings"):
        env.reset({**row, "attributes": "lightweight"})
    with pytest.raises(ValueError, match="not a product of this shop"):
        env.reset(goal_row(data_path, "B000000001"))
    with pytest.raises(RuntimeError, match="before reset"):
        WebShopEnv().step("search[x]")


def test_prompt_follows_verl_agent():
    env = WebShopEnv()
    row = all_rows()[0]
    obs, info = env.reset(row)
    first = env.render_prompt(info["task"], [], obs, info["admissible_actions"], 0)
    assert f"Your task is to: {row['instruction']}.\nYour current observation is: 'Search'.\n" in first
    assert "[\n'search[<your query>]',\n]" in first and "Prior to this step" not in first
    assert "<think> </think>" in first and "<action> </action>" in first
    later, *_, info = env.step("search[shoes]")
    prompt = env.render_prompt(info["task"], [(obs, "search[shoes]")], later, info["admissible_actions"], 1)
    assert "you have already taken 1 step(s). Below are the most recent 1 observations" in prompt
    assert "[Observation 1: ''Search'', Action 1: 'search[shoes]']" in prompt
    assert f"You are now at step 2 and your current observation is: {later}.\n" in prompt
    assert "'click[next >]',\n" in prompt


# The released WebShop prompt (agent_system/environments/prompts/webshop.py, filled by recipe/hgpo/env_manager.py):
# both templates open and close with a newline, and the first line ends "environment. " without history.
WEBSHOP_INSTRUCTION = (
    "Now it's your turn to take one action for the current step.\nYou should first reason step-by-step about the "
    "current situation, then think carefully which admissible action best advances the shopping goal. This "
    "reasoning process MUST be enclosed within <think> </think> tags. \nOnce you've finished your reasoning, you "
    "should choose an admissible action for current step and present it within <action> </action> tags.\n")


def test_prompt_is_released_character_by_character():
    env, task = WebShopEnv(), "i need a red shirt, and price lower than 30.00 dollars"
    first = env.render_prompt(task, [], "'Search'", ["search[<your query>]"], 0)
    assert first == (
        "\nYou are an expert autonomous agent operating in the WebShop e\u2011commerce environment. \nYour task is "
        "to: i need a red shirt, and price lower than 30.00 dollars.\nYour current observation is: 'Search'.\nYour "
        "admissible actions of the current situation are: \n[\n'search[<your query>]',\n].\n\n"
        + WEBSHOP_INSTRUCTION)
    page = "'Back to Search' [SEP] 'Page 1 (Total results: 1)' [SEP] 'B0001' [SEP] 'Red Shirt' [SEP] '$12.00'"
    later = env.render_prompt(task, [("'Search'", "search[red shirt]")], page, ["click[back to search]",
                                                                               "click[b0001]"], 1)
    assert later == (
        "\nYou are an expert autonomous agent operating in the WebShop e\u2011commerce environment.\nYour task is "
        "to: i need a red shirt, and price lower than 30.00 dollars.\nPrior to this step, you have already taken 1 "
        "step(s). Below are the most recent 1 observations and the corresponding actions you took: [Observation 1: "
        "''Search'', Action 1: 'search[red shirt]']\nYou are now at step 2 and your current observation is: "
        + page + ".\nYour admissible actions of the current situation are: \n[\n'click[back to search]',\n"
        "'click[b0001]',\n].\n\n" + WEBSHOP_INSTRUCTION)


def test_registry():
    assert "webshop" in registered_envs()
    env = make_env("webshop", max_steps=5)
    row = make_tasks("webshop", "test", num_tasks=2)[1]
    assert env.max_steps == 5 and env.reset(row)[0] == "'Search'"
    for bad, match in ((dict(invalid_notice="no"), "invalid_notice must be true or false, got 'no'"),
                       (dict(max_steps=0), "max_steps must be a positive integer"),
                       (dict(win_reward=float("nan")), "win_reward must be a finite number")):
        with pytest.raises(ValueError, match=match):
            make_env("webshop", **bad)
