"""Schedule files: CSV (torch's format) and JSON round trips, and only ScheduleError on bad input."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipetrain.plan import Action, ActionKind, Schedule, ScheduleError, build_schedule, schedule_names


def small_schedules() -> list[Schedule]:
    """One small compute-only and one lowered schedule of every generator that builds at 3 × 6."""
    out = []
    for name in schedule_names():
        for v in (None, 2):
            try:
                s = build_schedule(name, 3, 6, v)
            except ScheduleError:
                continue
            out += [s, s.lower()]
    return out


SCHEDULES = small_schedules()


def test_every_generator_is_covered() -> None:
    built = {s.name for s in SCHEDULES}
    assert built == set(schedule_names())


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: f"{s.name}-{'low' if s.is_lowered else 'compute'}")
def test_csv_round_trip(schedule: Schedule, tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    schedule.to_csv(path)
    back = Schedule.from_csv(path)
    # CSV drops trailing idle steps and infers placement; the programs and sizes survive.
    assert back.num_ranks == schedule.num_ranks
    assert back.num_stages == schedule.num_stages
    assert back.num_microbatches == schedule.num_microbatches
    assert back.stage_to_rank == schedule.stage_to_rank
    for r in range(schedule.num_ranks):
        assert [a for a in back.actions[r] if a] == [a for a in schedule.actions[r] if a]
        assert back.actions[r] == schedule.actions[r][: len(back.actions[r])]
    back.validate()


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: f"{s.name}-{'low' if s.is_lowered else 'compute'}")
def test_json_round_trip(schedule: Schedule, tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    schedule.to_json(path)
    back = Schedule.from_json(path)
    assert back == schedule
    assert back.name == schedule.name
    assert Schedule.load(path) == schedule
    assert Schedule.from_json(schedule.to_json()) == schedule


def test_csv_text_is_torch_format() -> None:
    s = build_schedule("GPipe", 2, 2)
    assert s.to_csv_text().splitlines() == ["0F0,0F1,0B0,0B1", "1F0,1F1,1B0,1B1"]


def test_csv_idle_cells_are_none() -> None:
    s = Schedule.from_csv_text("0F0,,0B0\n,1F0,1B0\n")
    assert s.actions == {
        0: [Action(0, ActionKind.F, 0), None, Action(0, ActionKind.B, 0)],
        1: [None, Action(1, ActionKind.F, 0), Action(1, ActionKind.B, 0)],
    }
    s.validate()


# ------------------------------------------------------------------ torch 2.15's waits
# torch 2.15.0's own dump of ScheduleZBVZeroBubble on 2 ranks, 2 microbatches, `_dump_csv(path,
# format="compute_comms")`: its lowered files hold WAIT_SEND_F, WAIT_SEND_B and WAIT_REDUCE_GRAD.
TORCH_215_ZBV = (
    "0UNSHARD,3UNSHARD,0F0,0SEND_F0,0F1,0SEND_F1,3RECV_F0,3F0,3I0,3SEND_B0,3RECV_F1,3W0,3F1,3I1,3SEND_B1,"
    "0RECV_B0,3W1,3REDUCE_GRAD,3WAIT_REDUCE_GRAD,3RESHARD,0I0,0WAIT_SEND_F0,0W0,0RECV_B1,0I1,0WAIT_SEND_F1,0W1,"
    "0REDUCE_GRAD,0WAIT_REDUCE_GRAD,0RESHARD,3WAIT_SEND_B0,3WAIT_SEND_B1\r\n"
    "1UNSHARD,2UNSHARD,1RECV_F0,1F0,1RECV_F1,2F0,2SEND_F0,1F1,2RECV_B0,2F1,2SEND_F1,2I0,2WAIT_SEND_F0,2W0,"
    "2RECV_B1,1I0,1SEND_B0,1W0,2I1,2WAIT_SEND_F1,2W1,2REDUCE_GRAD,2WAIT_REDUCE_GRAD,2RESHARD,1I1,1SEND_B1,1W1,"
    "1REDUCE_GRAD,1WAIT_REDUCE_GRAD,1RESHARD,1WAIT_SEND_B0,1WAIT_SEND_B1\r\n"
)


def test_torch_215_waits_are_read_and_dropped_keeping_the_order(tmp_path: Path) -> None:
    s = Schedule.from_csv_text(TORCH_215_ZBV)
    for rank, row in enumerate(TORCH_215_ZBV.splitlines()):
        assert [str(a) for a in s.actions[rank]] == [cell for cell in row.split(",") if "WAIT_" not in cell]
    assert (s.num_ranks, s.num_stages, s.num_microbatches) == (2, 4, 2)
    assert s.stage_to_rank == {0: 0, 1: 1, 2: 1, 3: 0}
    assert s.is_lowered
    s.validate()
    path = tmp_path / "zbv.csv"
    path.write_text(TORCH_215_ZBV, newline="")
    assert Schedule.load(path) == s == Schedule.from_csv(path)
    # Written without waits, it is torch 2.13's file of the same order.
    assert Schedule.from_csv_text(s.to_csv_text()) == s
    assert "WAIT_" not in s.to_csv_text()


def test_torch_waits_are_written_where_torch_places_them(tmp_path: Path) -> None:
    s = Schedule.from_csv_text(TORCH_215_ZBV)
    assert s.to_csv_text(torch_waits=True) == TORCH_215_ZBV
    path = tmp_path / "waits.csv"
    s.to_csv(path, torch_waits=True)
    assert path.read_bytes() == TORCH_215_ZBV.encode()
    assert Schedule.from_csv(path) == s


def test_torch_waits_rule_on_pipetrains_lowering() -> None:
    # 1F1B on 2 ranks: rank 0's forward sends are awaited after its backward of the same
    # microbatch, rank 1's backward sends at the end of its row, each reduction at once.
    s = build_schedule("1F1B", 2, 2).lower(grad_reduce=True)
    rows = s.to_csv_text(torch_waits=True).splitlines()
    assert rows == [
        "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0WAIT_SEND_F0,0RECV_B1,0B1,0WAIT_SEND_F1,0REDUCE_GRAD,0WAIT_REDUCE_GRAD",
        "1RECV_F0,1F0,1RECV_F1,1B0,1SEND_B0,1F1,1B1,1SEND_B1,1REDUCE_GRAD,1WAIT_REDUCE_GRAD,1WAIT_SEND_B0,1WAIT_SEND_B1",
    ]
    # A compute-only schedule has nothing to wait for, and keeps its idle cells.
    idle = Schedule.from_csv_text("0F0,,0B0\n,1F0,1B0\n")
    assert idle.to_csv_text(torch_waits=True) == idle.to_csv_text()


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: f"{s.name}-{'low' if s.is_lowered else 'compute'}")
def test_csv_round_trip_with_torch_waits(schedule: Schedule) -> None:
    text = schedule.to_csv_text(torch_waits=True)
    assert ("WAIT_SEND_" in text) == any(a is not None and a.kind.is_comm for a in schedule.iter_actions())
    back = Schedule.from_csv_text(text)
    assert back == schedule


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0F0,0WAIT_F0\n", "rank 0, step 1: cannot parse action '0WAIT_F0': torch's waits are written"),
        ("0F0,0SEND_F0,0WAIT_SEND_F\n", "step 2: cannot parse action '0WAIT_SEND_F': WAIT_SEND_F needs a microbatch"),
        ("0REDUCE_GRAD,0WAIT_REDUCE_GRAD0\n", "'0WAIT_REDUCE_GRAD0': WAIT_REDUCE_GRAD takes no microbatch"),
        ("0F0,0SEND_F0x,0WAIT_SEND_F0\n", "rank 0, step 1: cannot parse action '0SEND_F0x'"),
        ("0F0,0WAIT_SEND_F0x\n", "cannot parse action '0WAIT_SEND_F0x'"),
        (
            "0F0,0WAIT_SEND_F0,0SEND_F0\n",
            "rank 0, step 1: 0WAIT_SEND_F0 waits for 0SEND_F0, but rank 0 has no 0SEND_F0",
        ),
        ("0F0,0SEND_F0,0WAIT_SEND_F0,0WAIT_SEND_F0\n", "rank 0, step 3: 0WAIT_SEND_F0 waits for 0SEND_F0"),
        ("0F0,0SEND_F0,0WAIT_SEND_B0\n", "0WAIT_SEND_B0 waits for 0SEND_B0, but rank 0 has no 0SEND_B0"),
        ("0F0,0SEND_F0\n1RECV_F0,1F0,0WAIT_SEND_F0\n", "rank 1, step 2: 0WAIT_SEND_F0 waits for 0SEND_F0"),
        ("0F0,0B0,1WAIT_REDUCE_GRAD\n", "1WAIT_REDUCE_GRAD waits for 1REDUCE_GRAD, but rank 0 has no 1REDUCE_GRAD"),
    ],
)
def test_malformed_torch_waits_are_refused(text: str, expected: str) -> None:
    with pytest.raises(ScheduleError) as info:
        Schedule.from_csv_text(text)
    assert expected in str(info.value)


def test_waits_are_no_actions_outside_csv_files() -> None:
    with pytest.raises(ScheduleError, match=r"torch 2\.15's waits are not pipetrain actions"):
        Action.parse("0WAIT_SEND_F3")
    doc = {**build_schedule("GPipe", 2, 2).lower().to_dict()}
    doc["actions"] = {**doc["actions"], "0": [*doc["actions"]["0"], "0WAIT_SEND_F0"]}
    with pytest.raises(ScheduleError, match=r"rank 0, step 8: cannot parse action '0WAIT_SEND_F0': torch 2\.15's"):
        Schedule.from_dict(doc)


def test_format_grid_lists_every_action() -> None:
    s = build_schedule("GPipe", 2, 3)
    lines = s.format().splitlines()
    assert lines[0].split() == ["step", "rank", "0", "rank", "1"]
    assert len(lines) == 1 + s.num_steps
    assert lines[1].split() == ["0", "0F0", "1F0"]
    assert "more steps" in s.format(max_steps=2)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "no rows"),
        ("0F0,0X1\n", "rank 0, step 1"),
        ("0F0\n0F1\n", "stage 0 already runs on rank 0"),
        ("0F0\x00\n", "NUL"),
        ('0F0,"1F0,x"\n', "rank 0, step 1"),
    ],
)
def test_bad_csv_text(text: str, expected: str) -> None:
    with pytest.raises(ScheduleError) as info:
        Schedule.from_csv_text(text)
    assert expected in str(info.value)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ScheduleError, match="cannot read"):
        Schedule.from_csv(tmp_path / "missing.csv")
    binary = tmp_path / "b.csv"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ScheduleError, match="UTF-8"):
        Schedule.from_csv(binary)
    bad_json = tmp_path / "b.json"
    bad_json.write_text("{not json")
    with pytest.raises(ScheduleError, match="malformed schedule JSON"):
        Schedule.load(bad_json)
    other_json = tmp_path / "o.json"
    other_json.write_text('{"format": "something else"}')
    with pytest.raises(ScheduleError, match="not a pipetrain schedule"):
        Schedule.load(other_json)
    trace = tmp_path / "zbv.json"  # what `pipetrain simulate --trace zbv.json` writes
    from pipetrain.plan import build_schedule, simulate
    from pipetrain.plan.trace import write_chrome_trace

    write_chrome_trace(simulate(build_schedule("1F1B", 2, 2)).timeline, trace)
    with pytest.raises(ScheduleError, match="not a pipetrain schedule but a Chrome trace"):
        Schedule.load(trace)


CELL_TOKENS = [
    "0F0", "1F0", "0B0", "1B0", "0I0", "0W0", "1I1", "1W1", "0F1", "1F1", "0B1", "1B1", "2F0", "0F7",
    "0SEND_F0", "1RECV_F0", "1SEND_B0", "0RECV_B0", "0UNSHARD", "0RESHARD", "1REDUCE_GRAD",
    "(0F1;1B0)OVERLAP_F_B", "", "", "x", '"', "0F", "9F9", "(", ")OVERLAP_F_B", "0F0abc", "\n", ",",
    "0WAIT_SEND_F0", "1WAIT_SEND_B0", "1WAIT_REDUCE_GRAD", "0WAIT_F0", "WAIT_",
]  # fmt: skip


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.text(max_size=60),
        st.lists(st.lists(st.sampled_from(CELL_TOKENS), max_size=8).map(",".join), min_size=1, max_size=4).map(
            "\n".join
        ),
    )
)
def test_csv_fuzz_raises_only_schedule_error(text: str) -> None:
    """Malformed input, including schedules that parse but break rules, gives ScheduleError only."""
    try:
        schedule = Schedule.from_csv_text(text)
    except ScheduleError:
        return
    try:
        schedule.validate()
    except ScheduleError:
        return
    # A schedule that validates also lowers (if it is compute-only) and survives a round trip.
    if not schedule.is_lowered:
        schedule.lower().validate()
    assert Schedule.from_csv_text(schedule.to_csv_text()).actions.keys() == schedule.actions.keys()
    waits = Schedule.from_csv_text(schedule.to_csv_text(torch_waits=True))
    assert {r: [a for a in p if a] for r, p in waits.actions.items()} == {
        r: [a for a in p if a] for r, p in schedule.actions.items()
    }


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda c: st.lists(c) | st.dictionaries(st.text(max_size=8), c),
        max_leaves=12,
    )
)
def test_json_fuzz_raises_only_schedule_error(data: object) -> None:
    doc = {"format": "pipetrain.schedule", "actions": data}
    try:
        Schedule.from_dict(doc)
    except ScheduleError:
        pass


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=80) | st.lists(st.sampled_from(CELL_TOKENS), max_size=12).map(lambda t: ",".join(t).encode()))
def test_csv_file_fuzz_raises_only_schedule_error(data: bytes) -> None:
    """Arbitrary bytes on disk (bad UTF-8, NULs, junk cells) give ScheduleError only."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "fuzz.csv"
        path.write_bytes(data)
        try:
            Schedule.from_csv(path).validate()
        except ScheduleError:
            pass


def test_has_backward_tells_training_schedules_from_forward_only_ones() -> None:
    from pipetrain.plan.lower import forwards_only

    assert build_schedule("1F1B", 2, 4).has_backward
    assert build_schedule("ZBVZeroBubble", 2, 4).lower().has_backward
    assert not build_schedule("ForwardOnly", 2, 4).has_backward
    assert not forwards_only(build_schedule("DualPipeV", 2, 4)).lower().has_backward


# ------------------------------------------------------------------ implausible sizes
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0F0,0F30000000\n", "action 0F30000000: microbatch 30000000 implies 30000001 microbatches, but stage 0"),
        ("0F0,0B0,0F" + "9" * 40 + "\n", "but stage 0 has no forward 0F1; microbatches must be numbered 0..M-1"),
        ("0F0,0F" + "9" * 5000 + "\n", "rank 0, step 1: cannot parse action '0F9"),
        ("0F0,99999999999F0\n", "stages [1, 2, 3, 4, 5, 6, 7, 8] and 99999999990 more are not placed"),
        ("0F0,0F65536\n1F0\n", "microbatch 65536 implies 65537 microbatches, but stage 0 has no forward 0F1"),
        ("0F0,0F1,1F0\n2F0,2F40000\n", "microbatch 40000 implies 40001 microbatches, but stage 0 has no forward 0F2"),
    ],
)
def test_huge_indices_are_refused_before_any_table_is_built(text: str, expected: str) -> None:
    """A stray large index must not make validate/simulate allocate stages × microbatches entries."""
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(ScheduleError) as info:
            Schedule.from_csv_text(text)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert expected in str(info.value)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400
    assert peak < 5_000_000


def test_declared_sizes_beyond_the_actions_are_refused() -> None:
    doc = build_schedule("GPipe", 2, 2).to_dict()
    with pytest.raises(
        ScheduleError, match="the schedule has 1000000000000 microbatches, but stage 0 has no forward 0F2"
    ):
        Schedule.from_dict({**doc, "num_microbatches": 10**12})
    with pytest.raises(ScheduleError, match=r"stages \[2, 3, .* more are not placed"):
        Schedule.from_dict({**doc, "num_stages": 10**12})


@pytest.mark.parametrize("text", ["0F0,0F2\n", "0F0,,0F2\n", "0F0,0F65535\n"])
def test_gaps_in_small_schedules_still_get_validates_message(text: str) -> None:
    # Tables of up to 65536 (stage, microbatch) entries are cheap: loading succeeds, and validate
    # names the rank and the missing action, as lower() does.
    s = Schedule.from_csv_text(text)
    with pytest.raises(ScheduleError, match=r"^rank 0: stage 0 microbatch 1 has no forward 0F1"):
        s.validate()


# ------------------------------------------------------------------ JSON: paths, version, num_ranks
def test_a_json_file_named_like_json_text_is_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipetrain.plan.timeline import Timeline

    monkeypatch.chdir(tmp_path)  # a relative name that starts with '{'
    schedule = build_schedule("1F1B", 2, 3)
    schedule.to_json("{x}.json")
    assert Schedule.from_json("{x}.json") == schedule
    assert Schedule.load("{x}.json") == schedule
    assert Schedule.from_json_text(schedule.to_json()) == schedule
    assert Schedule.from_json(schedule.to_json()) == schedule  # older callers pass the text itself
    with pytest.raises(ScheduleError, match=r"^cannot read \{missing\}\.json: No such file"):
        Schedule.load("{missing}.json")
    from pipetrain.plan.simulate import simulate

    timeline = simulate(schedule).timeline
    timeline.to_json("{t}.json")
    assert Timeline.from_json("{t}.json").events == timeline.events
    assert Timeline.from_json_text(timeline.to_json()).events == timeline.events


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"version": 2}, "unsupported schedule JSON version 2: this pipetrain reads version 1"),
        ({"version": "1"}, "unsupported schedule JSON version '1'"),
        ({"num_ranks": 0}, "num_ranks must be an integer in 1..1048576, got 0"),
        ({"num_ranks": -3}, "num_ranks must be an integer in 1..1048576, got -3"),
        ({"num_ranks": "2"}, "num_ranks must be an integer in 1..1048576, got '2'"),
        ({"num_ranks": True}, "num_ranks must be an integer in 1..1048576, got True"),
        ({"num_ranks": 10**12}, "num_ranks must be an integer in 1..1048576"),
        ({"num_ranks": 1}, "actions are given for rank 1, but num_ranks is 1"),
        ({"num_microbatches": 1.5}, "num_microbatches must be an integer >= 0, got 1.5"),
        ({"actions": {"x": []}}, "\"actions\" has a key 'x' that is not a rank number"),
    ],
)
def test_json_header_fields_are_checked(change: dict[str, object], expected: str) -> None:
    doc = {**build_schedule("GPipe", 2, 2).to_dict(), **change}
    with pytest.raises(ScheduleError) as info:
        Schedule.from_dict(doc)
    assert expected in str(info.value)


def test_json_declared_ranks_without_actions_keep_their_size(tmp_path: Path) -> None:
    doc = {
        "format": "pipetrain.schedule",
        "version": 1,
        "num_ranks": 4,
        "actions": {"0": ["0F0", "0B0"]},
    }
    s = Schedule.from_dict(doc)
    assert s.num_ranks == 4
    assert s.actions == {0: [Action(0, ActionKind.F, 0), Action(0, ActionKind.B, 0)], 1: [], 2: [], 3: []}
    s.validate()
    path = tmp_path / "idle.json"
    s.to_json(path)
    assert Schedule.load(path) == s
    # A placement on a declared rank is checked against the declared size, not the ranks with actions.
    with pytest.raises(ScheduleError, match="stage_to_rank places stage 1 on rank 4, but there are 4 ranks"):
        Schedule.from_dict({**doc, "stage_to_rank": {"0": 0, "1": 4}})
    # without num_ranks the ranks are still those named
    assert Schedule.from_dict({k: v for k, v in doc.items() if k != "num_ranks"}).num_ranks == 1


def test_file_errors_name_the_file_once(tmp_path: Path) -> None:
    cases = {
        "b.csv": b"\xff\xfe\x00garbage",
        "cell.csv": b"0F0,0X1\n",
        "gap.csv": b"0F0,0F70000\n",
        "v.json": b'{"format": "pipetrain.schedule", "version": 9, "actions": {}}',
        "bad.json": b"{not json",
    }
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(ScheduleError) as info:
            Schedule.load(path)
        assert str(info.value).count(str(path)) == 1, str(info.value)
        assert str(info.value).startswith(f"{path}: "), str(info.value)


def test_a_missing_file_named_like_json_text_is_reported_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipetrain.plan.timeline import Timeline

    monkeypatch.chdir(tmp_path)
    for reader in (Schedule.from_json, Timeline.from_json):
        with pytest.raises(ScheduleError, match=r"^cannot read \{nope\}\.json: no such file, nor valid \w+ JSON text"):
            reader("{nope}.json")
    with pytest.raises(ScheduleError, match=r"^malformed timeline JSON"):
        Timeline.from_json('{\n"format": ')
