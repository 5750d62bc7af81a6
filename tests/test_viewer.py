"""The trajectory viewer (issue 48): what a dump holds for it (HGPO's groups and weights, the step's name), the
page it writes (self-contained, hostile text kept as data), the dataset, hgpo-view, and the page in a real
headless Chromium."""

import json
import re
import time

import numpy as np
import pytest

from hgpo_trl.advantages import compute_advantages
from hgpo_trl.evaluation.trajectories import (
    read_records,
    rollout_records,
    show_episode,
    summarize,
    to_dataset,
    to_html,
    view,
    view_data,
    write_records,
)
from tests.browser import BINARY, MISSING, Browser
from tests.test_trajectories import record_config, scripted_records, scripted_rollout

HOSTILE = ["<script>window.pwned = 1</script>", "</script><img src=x onerror='window.pwned = 2'>", "a\0b",
           "日本語のテキスト 중국어", "&lt;b&gt; <!-- --> ]]>", "x" * 100_000]


def hgpo_records(**fields):
    task, rollout = scripted_rollout()
    config = record_config(**fields)
    advantages = compute_advantages("hgpo", rollout.step_batch(), **config.estimator_options())
    return rollout_records(rollout, [task], advantages, config), advantages


def test_a_dump_names_the_step_and_a_dump_with_the_old_name_still_reads(tmp_path):
    records = scripted_records()
    assert all("t" not in r for r in records) and [r["step"] for r in records if r["episode"] == 0] == [0, 1, 2, 3]
    old = [{("t" if k == "step" else k): v for k, v in r.items()} for r in records]  # as dumps were written
    back = read_records(write_records(tmp_path / "old.jsonl", old))
    assert back == read_records(write_records(tmp_path / "new.jsonl", records))
    assert show_episode(back, 1) == show_episode(records, 1) and summarize(back) == summarize(records)
    (tmp_path / "bad.jsonl").write_text('{"step": 0}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 2 is not a JSON record"):
        read_records(tmp_path / "bad.jsonl")


def test_the_groups_and_weights_of_a_dump_rebuild_each_hgpo_advantage():
    # mean_std_norm, alpha 2, with and without the released drop_zero_items: the groups each step was normalised
    # in (its peers) and the weight of each level's item give back the advantage the trainer used.
    blended = [check_rebuilt(*hgpo_records(**options)) for options in ({"alpha": 2.0},
                                                                       {"alpha": 2.0, "drop_zero_items": True})]
    assert blended == [4, 0]  # steps whose advantage blends several levels (dropped: their deeper items are 0)
    assert all(r["level_weights"] is None for r in scripted_records())  # no advantages (an evaluation): none


def check_rebuilt(records, advantages) -> int:
    returns = np.array([r["return"] for r in records])
    ids = np.array([r["level_groups"] for r in records])
    for i, r in enumerate(records):
        rebuilt = 0.0
        for k, weight in enumerate(r["level_weights"]):
            members = returns[ids[:, k] == ids[i, k]] if ids[i, k] >= 0 else returns[[i]]
            item = (returns[i] - members.mean()) / (members.std() + 1e-6) if np.ptp(members) > 0 else 0.0
            rebuilt += weight * item
            assert weight == 0 or len(members) >= 2  # only a level with a peer weighs
        assert rebuilt == pytest.approx(advantages[i], abs=1e-9)
        on = [w for w in r["level_weights"] if w > 0]
        assert sum(on) == pytest.approx(1.0) if on else advantages[i] == 0
        if len(on) >= 2:  # power weighting: w_k proportional to (k + 2) ** alpha
            k = [j for j, w in enumerate(r["level_weights"]) if w > 0]
            assert on[-1] / on[0] == pytest.approx(((k[-1] + 2) / (k[0] + 2)) ** 2)
        assert r["peer_levels"] == [k for k in range(3) if ids[i, k] >= 0 and (ids[:, k] == ids[i, k]).sum() >= 2]
    return sum(len([w for w in r["level_weights"] if w > 0]) >= 2 for r in records)


def hostile_records():
    records = scripted_records()
    for r, text in zip(records, HOSTILE * 2, strict=False):
        r.update(prompt=text, output=text, observation=text)
    records[0]["task"] = {"goal": HOSTILE[0], "where": HOSTILE[3]}
    return records


def data_blocks(page: str) -> list:
    return [json.loads(block) for block in re.findall(r'<script type="application/json" id="[^"]+">(.*?)</script>',
                                                      page, flags=re.S)]


def test_the_page_is_self_contained_and_holds_hostile_text_as_data(tmp_path):
    records = hostile_records()
    page = to_html(write_records(tmp_path / "iter_000001.jsonl", records)).read_text()
    assert page.count("<script") == 3 and page.count("</script>") == 3  # the page's own, the index, the dump
    assert HOSTILE[0] not in page and "<img" not in page and "\0" not in page  # all of it JSON-escaped
    code = re.sub(r'<script type="application/json".*?</script>', "", page, flags=re.S)
    assert not re.search(r"(src|href)=|https?://|@import|url\(|fetch\(|XMLHttp", code)  # nothing fetched
    meta, dump = data_blocks(page)
    assert meta == [{"name": "iter_000001", "summary": view_data("x", records)["summary"], "training": False}]
    assert dump == {"episodes": view_data("iter_000001", records)["episodes"]}
    texts = {st["output"] for ep in dump["episodes"] for st in ep["steps"]}
    assert set(HOSTILE) <= texts and HOSTILE[0] in dump["episodes"][0]["task"]


def test_a_dump_as_a_dataset_one_row_a_step(tmp_path):
    records = scripted_records()
    dataset = to_dataset(write_records(tmp_path / "d.jsonl", records))
    assert len(dataset) == len(records) == 9 and {"step", "prompt", "advantage", "level_groups"} <= set(dataset.features)
    frame = dataset.to_pandas()
    assert frame.groupby("episode")["step"].max().to_dict() == {0: 3, 1: 4}
    assert json.loads(frame["task"][0]) == records[0]["task"]


def test_hgpo_view_writes_a_runs_page_and_refuses_a_missing_dump(tmp_path, capsys):
    run = tmp_path / "run"
    for name in ("iter_000001", "eval_step_000002", "iter_000011"):
        write_records(run / "trajectories" / f"{name}.jsonl", scripted_records())
    view([str(run), "--last", "2"])
    assert capsys.readouterr().out.strip() == str(run / "trajectories.html")
    assert [m["name"] for m in data_blocks((run / "trajectories.html").read_text())[0]] == \
        ["eval_step_000002", "iter_000011"]  # the two newest, in order
    with pytest.raises(SystemExit) as exit_info:
        view([str(tmp_path / "nothing")])
    assert exit_info.value.code == 2 and "hgpo-view: error: no trajectory dump at" in capsys.readouterr().err


def paper_sized_records(groups=16, rollouts=8, steps=50, prompt_chars=3000):
    """An iteration of the paper's size (16 x 8 ALFWorld episodes of 50 steps), prompts of ALFWorld's length."""
    rng = np.random.default_rng(0)
    filler = "You arrive at countertop 1. On the countertop 1, you see a apple 2, a knife 1. " * 60
    return [{"task": {"gamefile": f"game{g}"}, "task_type": "pick_and_place", "group": g, "episode": g * rollouts + e,
             "episode_won": bool(e % 2), "episode_fault": None, "episode_score": None, "step": t,
             "prompt": f"step {t} " + filler[:prompt_chars], "window": min(t, 2), "output": "<action>go to x</action>",
             "prompt_tokens": 900, "completion_tokens": 12, "action": "go to x", "valid": True,
             "observation": f"obs {t % 5}", "reward": 0.0, "return": float(rng.normal()),
             "advantage": float(rng.normal()), "level_groups": [g * 5 + t % 5, -1, -1], "peer_levels": [0],
             "level_weights": [1.0, 0.0, 0.0]}
            for g in range(groups) for e in range(rollouts) for t in range(steps)]


@pytest.mark.slow
@pytest.mark.skipif(BINARY is None, reason=MISSING)
def test_the_page_in_headless_chromium(tmp_path):
    records, _ = hgpo_records()
    browser = Browser(tmp_path / "profile")
    try:
        browser.open(to_html(write_records(tmp_path / "iter_000001.jsonl", records)))
        count = "document.querySelectorAll({!r}).length".format
        assert browser.evaluate(count("#overview .ep")) == 2 and browser.evaluate(count(".stepcard")) == 4
        assert browser.evaluate(count("td.cell")) == len(records) == 9
        # Episode 1's step 2 saw what episode 0's step 1 saw: a click draws that peer at level 0.
        browser.click('td.cell[data-ei="1"][data-si="2"]')
        assert browser.evaluate(count(".stepcard")) == 5
        assert browser.evaluate("[...document.querySelectorAll('td.cell.peer')].map(c => [c.dataset.ei, "
                                "c.dataset.si, c.classList.contains('peer-0')])") == [["0", "1", True]]
        assert "level 0: same current observation (GiGPO's anchor group): 1 peers · weight 1.000" in \
            browser.evaluate("document.getElementById('peers').innerText")
        browser.click('#filters button[data-filter="invalid"]')
        assert browser.evaluate(count("#overview .ep")) == 1
        browser.click("#worst")  # among the episodes the filter shows
        worst = min((r for r in records if r["episode"] == 1), key=lambda r: r["advantage"])
        head = browser.evaluate("document.querySelector('.stepcard.sel .stephead').innerText")
        assert head.startswith(f"step {worst['step']} ") and f"advantage {worst['advantage']:.3f}" in head
        assert len(browser.screenshot(tmp_path / "page.png").read_bytes()) > 20_000

        hostile = hostile_records()
        browser.open(to_html(write_records(tmp_path / "hostile.jsonl", hostile)))
        for episode in (0, 1):  # each episode's texts shown as they are, none run or parsed
            browser.click(f'#overview .ep[data-ei="{episode}"]')
            shown = browser.evaluate("document.getElementById('detail').textContent")
            assert all(r["output"] in shown for r in hostile if r["episode"] == episode)
            assert browser.evaluate("window.pwned === undefined && document.querySelectorAll('img').length === 0")
        assert set(HOSTILE) <= {r["output"] for r in hostile} and HOSTILE[0] in browser.evaluate(
            "document.getElementById('overview').textContent")  # the task's text, in the overview

        seconds = browser.open(to_html(write_records(tmp_path / "paper.jsonl", paper_sized_records())))
        assert browser.evaluate(count("#overview .ep")) == 128 and browser.evaluate(count("td.cell")) == 8 * 50
        tick = time.perf_counter()
        browser.click('#overview .ep[data-ei="127"]')
        browser.click('td.cell[data-ei="127"][data-si="49"]')
        assert browser.evaluate(count("td.cell.peer")) == 8 * 10 - 1  # obs t % 5: 10 steps an episode share one
        print(f"paper-sized dump: drawn in {seconds:.2f} s, episode and step selected in "
              f"{time.perf_counter() - tick:.2f} s")
        assert seconds < 20
    finally:
        browser.close()


# What the page shows: the dump, the episode and the selected step (None: no step selected), and its link line.
SHOWN = ("[document.getElementById('dump').selectedOptions[0].text.split(' ')[0], "
         "document.querySelector('#detail h2').innerText.split(' · ')[0], "
         "(document.querySelector('.stepcard.sel .stephead') || {innerText: 'step null'}).innerText.split(' ')[1], "
         "document.getElementById('link').textContent]")


@pytest.mark.slow
@pytest.mark.skipif(BINARY is None, reason=MISSING)
def test_a_runs_page_opens_on_its_newest_training_iteration_and_its_address_is_a_link_to_what_it_shows(tmp_path):
    # Issue 55 item 18: the page opened on the newest dump, an evaluation's (one episode a task: no groups, every
    # advantage "-"), and no address could name a dump or an episode.
    run = tmp_path / "run"
    training, _ = hgpo_records()
    for name, records in (("iter_000001", training), ("iter_000011", training),
                          ("eval_step_000020", scripted_records())):  # an evaluation's: no advantages
        write_records(run / "trajectories" / f"{name}.jsonl", records)
    page = to_html(run)
    browser = Browser(tmp_path / "profile")
    try:
        browser.open(page)
        assert browser.evaluate(SHOWN) == ["iter_000011", "episode 0", "null", ""]
        assert browser.evaluate("location.hash") == "#dump=iter_000011&episode=0"
        assert browser.evaluate("document.querySelectorAll('td.cell.pos, td.cell.neg').length") > 0

        # A person chooses a dump, an episode and a step: the address names them, and opens them again.
        browser.evaluate("(s => { s.value = 0; s.dispatchEvent(new Event('change')); })"
                         "(document.getElementById('dump'))")
        browser.click('#overview .ep[data-ei="1"]')
        browser.click('td.cell[data-ei="1"][data-si="2"]')
        assert browser.evaluate("location.hash") == "#dump=iter_000001&episode=1&step=2"
        shown = browser.evaluate(SHOWN)
        browser.open(page, "dump=iter_000001&episode=1&step=2")
        assert browser.evaluate(SHOWN) == shown == ["iter_000001", "episode 1", "2", ""]
        browser.evaluate("location.hash = '#dump=eval_step_000020&episode=0'")  # edited in the address bar
        for _ in range(100):
            if browser.evaluate(SHOWN)[0] == "eval_step_000020":
                break
            time.sleep(0.05)
        assert browser.evaluate(SHOWN) == ["eval_step_000020", "episode 0", "null", ""]

        # A link to what the page does not hold says so in one line and shows what it would have shown.
        browser.open(page, "dump=iter_000099&episode=1")
        assert browser.evaluate(SHOWN) == ["iter_000011", "episode 0", "null",
                                           "the link's dump iter_000099 is not on this page"]
        browser.open(page, "dump=eval_step_000020&episode=7&step=0")
        assert browser.evaluate(SHOWN) == ["eval_step_000020", "episode 0", "null",
                                           "the link's episode 7 is not in eval_step_000020"]
    finally:
        browser.close()
