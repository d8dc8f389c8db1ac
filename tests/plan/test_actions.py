"""Action: torch's grammar both ways, strict parsing, and only ScheduleError on bad input."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.plan import Action, ActionKind, ScheduleError

WITH_MB = [k for k in ActionKind if k.needs_microbatch]
WITHOUT_MB = [ActionKind.UNSHARD, ActionKind.RESHARD, ActionKind.REDUCE_GRAD]
COMPUTE = [ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W]

plain_actions = st.one_of(
    st.builds(Action, st.integers(0, 10_000), st.sampled_from(WITH_MB), st.integers(0, 10_000), st.none()),
    st.builds(Action, st.integers(0, 10_000), st.sampled_from(WITHOUT_MB), st.none(), st.none()),
)
compute_actions = st.builds(Action, st.integers(0, 99), st.sampled_from(COMPUTE), st.integers(0, 99), st.none())
overlap_actions = st.lists(compute_actions, min_size=2, max_size=3).map(lambda parts: Action.overlap(*parts))
any_action = st.one_of(plain_actions, overlap_actions)


@pytest.mark.parametrize(
    ("text", "stage", "kind", "mb"),
    [
        ("2F0", 2, ActionKind.F, 0),
        ("3I5", 3, ActionKind.I, 5),
        ("0W12", 0, ActionKind.W, 12),
        ("1SEND_F3", 1, ActionKind.SEND_F, 3),
        ("4RECV_B0", 4, ActionKind.RECV_B, 0),
        ("0UNSHARD", 0, ActionKind.UNSHARD, None),
        ("7REDUCE_GRAD", 7, ActionKind.REDUCE_GRAD, None),
        ("  1B2 ", 1, ActionKind.B, 2),
    ],
)
def test_parse_known_strings(text: str, stage: int, kind: ActionKind, mb: int | None) -> None:
    action = Action.parse(text)
    assert action == Action(stage, kind, mb)
    assert str(action) == text.strip()


def test_parse_overlap() -> None:
    action = Action.parse("(0F7;7B3)OVERLAP_F_B")
    assert action is not None
    assert action.kind is ActionKind.OVERLAP_F_B
    assert action.parts == (Action(0, ActionKind.F, 7), Action(7, ActionKind.B, 3))
    assert str(action) == "(0F7;7B3)OVERLAP_F_B"


@pytest.mark.parametrize("text", ["", "   ", "\t"])
def test_empty_cell_is_idle(text: str) -> None:
    assert Action.parse(text) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2F0abc", "expected <stage><kind><microbatch>"),  # torch 2.13 reads this as 2F0
        ("F0", "expected <stage><kind><microbatch>"),
        ("2X0", "expected <stage><kind><microbatch>"),
        ("2F", "needs a microbatch"),
        ("1SEND_F", "needs a microbatch"),
        ("0UNSHARD3", "takes no microbatch"),
        ("-1F0", "expected <stage><kind><microbatch>"),
        ("(0F1)OVERLAP_F_B", "at least two sub-actions"),
        ("(0F1;1B0)", "expected '(<action>;<action>)OVERLAP_F_B'"),
        ("(0F1;;1B0)OVERLAP_F_B", "empty sub-action"),
        ("(0F1;1SEND_F0)OVERLAP_F_B", "may only hold F, B, I or W"),
        ("((0F1;1B0)OVERLAP_F_B;2F0)OVERLAP_F_B", "cannot be nested"),
    ],
)
def test_parse_rejects_with_reason(text: str, expected: str) -> None:
    with pytest.raises(ScheduleError) as info:
        Action.parse(text)
    assert expected in str(info.value)


def test_parse_rejects_non_strings() -> None:
    with pytest.raises(ScheduleError, match="string"):
        Action.parse(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((0, "F", 0), "ActionKind"),
        ((-1, ActionKind.F, 0), "stage must be >= 0"),
        ((0, ActionKind.F, -2), "microbatch must be >= 0"),
        ((0, ActionKind.F, None), "needs a microbatch"),
        ((0, ActionKind.RESHARD, 1), "takes no microbatch"),
        ((1.5, ActionKind.F, 0), "integer"),
        ((True, ActionKind.F, 0), "integer"),
        ((0, ActionKind.F, 0, (Action(0, ActionKind.F, 0),)), "only OVERLAP_F_B carries sub-actions"),
    ],
)
def test_constructor_checks(args: tuple[object, ...], expected: str) -> None:
    with pytest.raises(ScheduleError) as info:
        Action(*args)  # type: ignore[arg-type]
    assert expected in str(info.value)


def test_actions_are_immutable_and_hashable() -> None:
    a = Action(1, ActionKind.F, 2)
    with pytest.raises(AttributeError):
        a.stage = 3  # type: ignore[misc]
    assert {a, Action(1, ActionKind.F, 2)} == {a}
    assert a != Action(1, ActionKind.B, 2)


@settings(max_examples=300, deadline=None)
@given(any_action)
def test_str_parse_round_trip(action: Action) -> None:
    assert Action.parse(str(action)) == action


TOKENS = [k.value for k in ActionKind] + ["(", ")", ";", "0", "1", "12", "-", " ", "abc", "_"]


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(max_size=30), st.lists(st.sampled_from(TOKENS), max_size=8).map("".join)))
def test_parse_fuzz_raises_only_schedule_error(text: str) -> None:
    try:
        action = Action.parse(text)
    except ScheduleError:
        return
    if action is not None:
        # Whatever parses prints in canonical form, which parses back to the same action.
        assert Action.parse(str(action)) == action
