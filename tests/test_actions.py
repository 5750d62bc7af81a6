"""The action parser: tags mode as released, plain mode for tiny models."""

import pytest

from hgpo_trl.rollout.actions import invalid_tail, parse_action, project_released

TAGS = [
    ("<think>the key is red</think><action>open red door</action>", "open red door"),
    ("<think>x</think>\n<action>  Go To   Hall \n</action> trailing", "go to hall"),
    ("<think>a</think><action>first</action><action>second</action>", "first"),
    # An action tag inside the reasoning does not count: the answer comes after </think>.
    ("<think>maybe <action>wrong</action></think><action>right</action>", "right"),
    ("<think>x</think>no tags", None),
    ("<action>go</action>", None),  # no think block
    ("<think>unclosed <action>go</action>", None),
    ("</think><think>x<action>go</action>", None),  # </think> before <think>
    ("<think>x</think><action></action>", None),  # empty
    ("<think>x</think><action>  </action>", None),
    ("<think>x</think><action><action>go</action></action>", None),  # nested tag inside the action
    ("<think>x</think><action>go</action", None),  # unclosed action
    ("<think>这是</think><action>go</action>", None),  # CJK rejected, as released
    ("", None),
    ("<think>x</think><action>click[next >]</action>", "click[next >]"),
]


@pytest.mark.parametrize(("text", "expected"), TAGS)
def test_tags_mode(text, expected):
    assert parse_action(text) == expected


def test_tags_mode_options():
    assert parse_action("<action>go</action>", require_think=False) == "go"
    assert parse_action("<think><action>no</action></think><action>yes</action>", require_think=False) == "yes"
    assert parse_action("<think>这</think><action>go</action>", reject_cjk=False) == "go"
    assert parse_action("<think>x</think><action>" + "a" * 201 + "</action>") is None


def test_plain_mode():
    assert parse_action("  Go to Hall\n", mode="plain") == "go to hall"
    assert parse_action("\n go to hall \n go to", mode="plain") == "go to hall"  # the first non-empty line
    assert parse_action("   ", mode="plain") is None
    assert parse_action("go <action>", mode="plain") is None
    assert parse_action("click[< prev]", mode="plain") == "click[< prev]"  # WebShop's paging actions


def test_bad_mode_and_non_text():
    with pytest.raises(ValueError, match="action mode must be one of"):
        parse_action("go", mode="json")
    assert parse_action(None) is None
    assert parse_action(b"<think></think><action>go</action>") is None


def test_invalid_tail_keeps_the_end_of_the_output():
    assert invalid_tail("x" * 50 + " I will  go\nto the hall") == ("x" * 50 + " I will go to the hall")[-30:]
    assert invalid_tail("") == ""
    assert invalid_tail("anything", 0) == ""  # an environment that shows nothing of an invalid output


def test_an_admissible_action_matches_up_to_case_and_the_spaces_a_word_level_tokenizer_puts_around_brackets():
    from hgpo_trl.rollout.actions import match_admissible

    admissible = ["search[<your query>]", "click[B07XYZ]", "click[back to search]", "go to hall"]
    assert match_admissible("search [ < your query > ]", admissible) == "search[<your query>]"
    assert match_admissible("click [ b07xyz ]", admissible) == "click[B07XYZ]"  # as the environment writes it
    assert match_admissible("go to hall", admissible) == "go to hall"
    assert match_admissible("go to  hall ", admissible) == "go to hall"
    assert match_admissible("click [ back ]", admissible) is None and match_admissible("go tohall", admissible) is None
    assert match_admissible(None, admissible) is None


# The released projection (verl-agent env_package/{alfworld,webshop}/projection.py), rule by rule:
# (output, ALFWorld's 30-character tail) -> (text sent to the environment, valid).
RELEASED = [
    # the whole output lower-cased; the first <action> and the first </action> anywhere, inside the reasoning too
    ("<think>maybe <action>Go To Desk 1</action></think><action>look</action>", ("go to desk 1", True)),
    ("<think>x</think><ACTION>Look</Action>", ("look", True)),
    # the action is only stripped: inner whitespace stays
    ("<think>x</think><action> go  to\ndesk 1 \n</action>", ("go  to\ndesk 1", True)),
    # empty between the tags, or the closing tag first: an empty action, valid
    ("<think>x</think><action></action>", ("", True)),
    ("<think>x</think></action>go to desk 1<action>", ("", True)),
    # no length cap
    ("<think>x</think><action>" + "a" * 500 + "</action>", ("a" * 500, True)),
    # no <think> or no </think> (case-sensitive, order not checked): invalid, the action still sent
    ("<action>go to desk 1</action>", ("go to desk 1", False)),
    ("<think>x<action>look</action>", ("look", False)),
    ("<THINK>x</THINK><action>look</action>", ("look", False)),
    ("</think>x<think><action>look</action>", ("look", True)),
    # a character in U+4E00-U+9FFF anywhere: invalid, the action still sent; kana and Hangul are not
    ("<think>这是</think><action>look</action>", ("look", False)),
    ("<think>カタカナ 한국어</think><action>look</action>", ("look", True)),
    # no action block: the output's last 30 characters, lower-cased, whitespace as it was
    ("<think>x</think>I Will Go To The Drawer 1,\n\tThen Look", ("go to the drawer 1,\n\tthen look", False)),
    ("<think>x</think><action>look", ("<think>x</think><action>look", False)),  # 28 characters: all of it
    ("", ("", False)),
]


@pytest.mark.parametrize("text, expected", RELEASED)
def test_released_projection_rule_by_rule(text, expected):
    assert project_released(text, 30) == expected


def test_released_projection_tail_is_the_environments():
    text = "I will go to the drawer 1 and then look"
    assert project_released(text, 30) == (" to the drawer 1 and then look", False)  # ALFWorld
    assert project_released(text, 20) == ("awer 1 and then look", False)  # WebShop
    assert project_released(text, 0) == ("", False)


def test_released_projection_options_relax_its_validity_rules():
    assert project_released("<action>look</action>", require_think=False) == ("look", True)
    assert project_released("<think>这</think><action>look</action>", reject_cjk=False) == ("look", True)
    assert project_released("no block", require_think=False, reject_cjk=False) == ("no block", False)
