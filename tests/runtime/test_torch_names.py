"""Every name torch.distributed.pipelining exports, and every name torchtitan imports from it,
exists in pipetrain with the same meaning (listed from the installed packages, not by hand)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

import pipetrain
import pipetrain.schedules as pt_schedules
import pipetrain.stage as pt_stage

torch_pipelining = pytest.importorskip("torch.distributed.pipelining")
torch_schedules = importlib.import_module("torch.distributed.pipelining.schedules")

pytestmark = pytest.mark.torch_interop

OURS = {
    "torch.distributed.pipelining": pipetrain,
    "torch.distributed.pipelining.schedules": pt_schedules,
    "torch.distributed.pipelining.stage": pt_stage,
}


def _torchtitan_imports() -> set[tuple[str, str]]:
    """(module, name) of every ``from torch.distributed.pipelining[.schedules|.stage] import name``
    in torchtitan's installed source (read, not imported)."""
    spec = importlib.util.find_spec("torchtitan")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torchtitan is not installed (dev extra, Python >= 3.11)")
    found = set()
    for path in Path(next(iter(spec.submodule_search_locations))).rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if "torch.distributed.pipelining" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module in OURS:
                found.update((node.module, alias.name) for alias in node.names)
    return found


def test_every_name_in_torch_pipelining_all_exists() -> None:
    names = list(torch_pipelining.__all__)
    assert {"pipeline", "SplitPoint", "PipelineStage", "ScheduleDualPipeV"} <= set(names)
    missing = [n for n in names if not hasattr(pipetrain, n)]
    assert not missing, f"in torch.distributed.pipelining.__all__ but not in pipetrain: {missing}"
    for name in names:
        if name.startswith("Schedule"):
            assert issubclass(getattr(pipetrain, name), pt_schedules._PipelineSchedule), name


def test_every_name_torchtitan_imports_exists() -> None:
    imports = _torchtitan_imports()
    assert ("torch.distributed.pipelining.schedules", "_PipelineSchedule") in imports
    assert ("torch.distributed.pipelining.schedules", "OVERLAP_F_B") in imports
    missing = sorted(f"{mod}.{name}" for mod, name in imports if not hasattr(OURS[mod], name))
    assert not missing, f"torchtitan imports these, pipetrain lacks them: {missing}"


def test_the_names_mean_what_they_mean_in_torch() -> None:
    s = pt_schedules
    # the same class hierarchy as torch's, under the base torchtitan types schedules with
    for single in (s.ScheduleGPipe, s.Schedule1F1B):
        assert issubclass(single, s.PipelineScheduleSingle) and not issubclass(single, s.PipelineScheduleMulti)
    for multi in (s.ScheduleInterleaved1F1B, s.ScheduleZBVZeroBubble, s.ScheduleDualPipeV, s._PipelineScheduleRuntime):
        assert issubclass(multi, s.PipelineScheduleMulti) and issubclass(multi, s._PipelineSchedule)
    for name in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV", "InterleavedZeroBubble", "GPipe"):
        assert s.get_schedule_class(name).__name__ == torch_schedules.get_schedule_class(name).__name__
    # action kinds: torch's constants and pipetrain's name the same actions
    for const in ("FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "OVERLAP_F_B", "UNSHARD"):
        assert getattr(s, const).value == getattr(torch_schedules, const).value, const
    theirs = torch_schedules._Action.from_str("(0F1;3B0)OVERLAP_F_B")
    ours = s._Action.from_str(str(theirs))
    assert str(ours) == str(theirs)
    assert [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in ours.sub_actions or ()] == [
        (a.stage_index, a.computation_type.value, a.microbatch_index) for a in theirs.sub_actions or ()
    ]
    ctx = s._PipelineContext("sched", [(1,)], [{}], [2], [])  # torch's positional order
    assert (ctx.schedule_ref, ctx.arg_mbs, ctx.kwarg_mbs, ctx.target_mbs, ctx.losses) == (
        "sched",
        [(1,)],
        [{}],
        [2],
        [],
    )
    assert pt_stage._normalize_model_output_as_tuple([1, 2]) == (1, 2)
    assert pt_stage._normalize_model_output_as_tuple(3) == (3,)


def test_torch_schedule_helpers_read_and_check_orders_as_torch_does() -> None:
    """``F``/``B``/``I``/``W``, ``_format_pipeline_order`` and ``_validate_schedule`` of torch's
    schedules module: same kinds, a grid naming ranks and steps, the same stage → rank mapping,
    and AssertionError (torch's type) for an order that cannot run."""
    s = pt_schedules
    for short in ("F", "B", "I", "W"):
        assert getattr(s, short).value == getattr(torch_schedules, short).value, short
        assert short not in s.__all__  # as in torch: `from ... import *` leaves a user's F alone
    order = {
        r: [torch_schedules._Action.from_str(a) if a else None for a in row]
        for r, row in {0: ["0F0", "0F1", "", "0B0", "0B1"], 1: ["", "1F0", "1B0", "1F1", "1B1"]}.items()
    }
    assert s._validate_schedule(order, 2, 2, 2) == torch_schedules._validate_schedule(order, 2, 2, 2) == {0: 0, 1: 1}
    grid = s._format_pipeline_order(order, error_step_number=2)
    lines = grid.splitlines()
    assert lines[0].split() == ["Rank", "0", "Rank", "1"]
    assert lines[1].split() == ["Step", "0", "0F0"] and lines[3].endswith("<-- ERROR HERE")
    broken = {0: order[0][:3], 1: order[1]}  # rank 0 never runs its backwards
    with pytest.raises(AssertionError):
        torch_schedules._validate_schedule(broken, 2, 2, 2)
    with pytest.raises(
        AssertionError, match=r"(?s)rank 0, step 0, action 0F0: has no backward.*Full pipeline schedule:.*Rank 0"
    ):
        s._validate_schedule(broken, 2, 2, 2)
    with pytest.raises(AssertionError, match=r"expected 0\.\.2"):
        s._validate_schedule(order, 3, 2, 2)
