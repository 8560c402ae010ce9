import pytest

from trainer.control.collapse import (
    CollapseBounds,
    CollapseSignals,
    backed_by_reward,
    check,
    distinct_share,
    empty_share,
    health_problems,
    mean_length,
    measure,
    movement_problems,
    repetition,
)

HEALTHY = [
    "Your order ships on Monday and arrives within three days.",
    "I reset the password; check your inbox for the link.",
    "The refund was issued to the original card.",
    "Sure, here is the invoice for March.",
]


def test_distinct_share_counts_whitespace_variants_as_one() -> None:
    assert distinct_share(["a b", "a  b", " a b\n", "c"]) == pytest.approx(2 / 4)
    assert distinct_share(["same"] * 8) == pytest.approx(1 / 8)
    assert distinct_share(HEALTHY) == 1.0


def test_empty_share_and_mean_length() -> None:
    replies = ["", "  \n", "ok", "four"]
    assert empty_share(replies) == pytest.approx(0.5)
    assert mean_length(replies) == pytest.approx((0 + 3 + 2 + 4) / 4)


def test_repetition_on_hand_made_replies() -> None:
    # "ok ok ok ok ok": 3 trigrams, all ("ok","ok","ok") -> 1 - 1/3
    assert repetition(["ok ok ok ok ok"]) == pytest.approx(2 / 3)
    # "a b c a b c": trigrams abc, bca, cab, abc -> 3 distinct of 4 -> 0.25
    assert repetition(["a b c a b c"]) == pytest.approx(0.25)
    # no repeats -> 0; replies shorter than 3 words are left out of the mean
    assert repetition(["one two three four", "hi"]) == 0.0
    assert repetition(["ok ok ok ok ok", "one two three four"]) == pytest.approx((2 / 3 + 0) / 2)
    assert repetition(["hi", ""]) == 0.0
    # bigrams: "x y x y" -> xy, yx, xy -> 1 - 2/3
    assert repetition(["x y x y"], n=2) == pytest.approx(1 / 3)


def test_measure_fills_every_signal() -> None:
    signals = measure(["a b c a b c", ""], token_entropies=[1.0, 2.0, 3.0], kl_to_base=0.05)
    assert signals == CollapseSignals(
        count=2,
        distinct_share=1.0,
        empty_share=0.5,
        mean_length=5.5,
        repetition=0.25,
        mean_entropy=2.0,
        kl_to_base=0.05,
    )
    scored = measure(["a", "b", "c"], kl_to_start=0.1, rewards=[1.0, 0.0])
    assert scored.kl_to_start == 0.1 and scored.reward == 0.5
    assert measure(["a"], rewards=[]).reward is None
    assert measure(["x"]).mean_entropy is None
    with pytest.raises(ValueError, match="at least one reply"):
        measure([])


def test_healthy_set_passes_against_itself() -> None:
    base = measure(HEALTHY, token_entropies=[1.2, 0.8], kl_to_base=0.0)
    now = measure(list(reversed(HEALTHY)), token_entropies=[1.0, 0.9], kl_to_base=0.02)
    assert check(now, CollapseBounds(), base) == []
    assert check(now, CollapseBounds()) == []


def test_constant_reply_is_flagged() -> None:
    base = measure(HEALTHY)
    collapsed = measure(["Thank you for contacting us."] * 8)
    problems = check(collapsed, CollapseBounds(), base)
    assert len(problems) == 2
    assert problems[0].startswith("distinct_share 0.125 < floor 0.250")
    assert "0.5 × baseline 1.000" in problems[1]


def test_diversity_ratio_needs_a_baseline() -> None:
    # 3 distinct of 10 passes the absolute floor but is < half of a fully distinct baseline
    replies = ["The order shipped today.", "Your refund is on its way.", "Please restart the app."]
    now = measure(replies + replies[:1] * 7)
    assert check(now, CollapseBounds()) == []
    assert check(now, CollapseBounds(), measure(HEALTHY)) == [
        "distinct_share 0.300 < 0.500 (0.5 × baseline 1.000)"
    ]


def test_empty_replies_repetition_and_kl_are_flagged() -> None:
    signals = measure(["", "ok ok ok ok ok", "fine thanks", "yes"], kl_to_base=0.9, kl_to_start=0.6)
    problems = check(signals, CollapseBounds())
    assert problems == [
        "empty_share 0.250 > 0.050",
        "repetition 0.667 > 0.500",
        "kl_to_start 0.6000 > 0.5000 nats/token",
    ]
    # The distance to the base model is bounded only when asked: a policy improving run after run travels far.
    capped = check(signals, CollapseBounds(max_kl_to_base=0.3))
    assert capped[-1] == "kl_to_base 0.9000 > 0.3000 nats/token"


def test_short_nonsense_and_entropy_drop_are_flagged_against_baseline() -> None:
    base = measure(HEALTHY, token_entropies=[2.0])
    now = measure(["qz", "xv", "pl", "mm"], token_entropies=[0.1])
    problems = check(now, CollapseBounds(), base)
    assert [p.split()[0] for p in problems] == ["mean_length", "mean_entropy"]
    # looser bounds let the same set pass
    loose = CollapseBounds(min_length_ratio=0.01, min_entropy_ratio=0.01)
    assert check(now, loose, base) == []


def test_distinct_share_counts_a_sure_answer_to_one_question_once() -> None:
    sure = ["cold", "cold", "cold", "small", "small", "small"]
    asked = ["hot", "hot", "hot", "big", "big", "big"]
    assert distinct_share(sure) == pytest.approx(2 / 6)  # pooled, confidence looks like collapse
    assert distinct_share(sure, asked) == 1.0  # per question, each answer counts once
    constant = ["cold"] * 6  # the same reply whatever the question: collapse either way
    assert distinct_share(constant, asked) == pytest.approx(1 / 2)
    assert measure(sure, contexts=asked).distinct_share == 1.0
    with pytest.raises(ValueError, match="one context per reply"):
        distinct_share(sure, asked[:2])


# One-word answers to four different questions: what "terse because terse is right" looks like.
QUESTIONS = ["hot", "big", "fast", "up"] * 2
RAMBLING = [
    'The opposite of "hot" is something like warm or maybe cool, it depends.',
    "Big things are large; the opposite could be many things in English.",
    "Fast means quick. Slow is one answer, but there are several others too.",
    "Up is a direction. Down, below or beneath could all be the opposite here.",
] * 2


def test_a_policy_that_became_terse_because_the_reward_asked_is_not_collapse() -> None:
    base = measure(RAMBLING, token_entropies=[2.0], contexts=QUESTIONS, rewards=[0.0] * 7 + [1.0])
    terse = ["cold", "small", "slow", "down"] * 2
    now = measure(
        terse, token_entropies=[0.2], contexts=QUESTIONS, kl_to_start=1.4, rewards=[1.0] * 7 + [0.0]
    )
    bounds = CollapseBounds()
    moved = [p.split()[0] for p in movement_problems(now, bounds, base)]
    assert moved == ["kl_to_start", "mean_length", "mean_entropy"]
    assert health_problems(now, bounds, base) == []
    assert backed_by_reward(now, bounds, base)
    assert check(now, bounds, base) == []
    # The same replies without reward evidence: every movement bound applies.
    unscored = measure(terse, token_entropies=[0.2], contexts=QUESTIONS, kl_to_start=1.4)
    assert [p.split()[0] for p in check(unscored, bounds, base)] == moved


def test_a_reward_that_did_not_rise_enough_waives_nothing() -> None:
    base = measure(RAMBLING, contexts=QUESTIONS, rewards=[0.5] * 8)
    terse = ["cold", "small", "slow", "down"] * 2
    same = measure(terse, contexts=QUESTIONS, rewards=[0.5] * 8)
    assert not backed_by_reward(same, CollapseBounds(), base)
    assert [p.split()[0] for p in check(same, CollapseBounds(), base)] == ["mean_length"]
    slightly = measure(terse, contexts=QUESTIONS, rewards=[0.5] * 7 + [1.0])  # +0.0625
    assert backed_by_reward(slightly, CollapseBounds(), base)
    assert not backed_by_reward(slightly, CollapseBounds(min_reward_gain=0.1), base)


@pytest.mark.parametrize(
    "gamed",
    [
        pytest.param([""] * 8, id="empty replies"),
        pytest.param(["cold"] * 8, id="one reply to every question"),
        pytest.param(["no no no no no no"] * 8, id="a loop"),
    ],
)
def test_a_reward_rising_on_broken_replies_is_gamed_and_backs_nothing(gamed: list[str]) -> None:
    base = measure(RAMBLING, contexts=QUESTIONS, rewards=[0.2] * 8)
    now = measure(gamed, contexts=QUESTIONS, kl_to_start=2.0, rewards=[1.0] * 8)
    bounds = CollapseBounds()
    assert health_problems(now, bounds, base)
    assert not backed_by_reward(now, bounds, base)
    flagged = {p.split()[0] for p in check(now, bounds, base)}
    assert {"kl_to_start", "mean_length"} <= flagged
