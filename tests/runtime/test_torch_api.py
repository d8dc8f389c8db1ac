"""The schedule classes have torch.distributed.pipelining's call signatures and hierarchy."""

from __future__ import annotations


def test_schedule_classes_take_torchs_arguments_in_torchs_order() -> None:
    """A call written for torch.distributed.pipelining, positional arguments included, means the
    same here; the class hierarchy answers issubclass the same way."""
    import inspect

    import torch.distributed.pipelining.schedules as theirs

    import pipetrain

    names = [
        "ScheduleGPipe",
        "Schedule1F1B",
        "ScheduleInterleaved1F1B",
        "ScheduleLoopedBFS",
        "ScheduleInterleavedZeroBubble",
        "ScheduleZBVZeroBubble",
        "ScheduleDualPipeV",
        "PipelineScheduleSingle",
        "PipelineScheduleMulti",
    ]
    for name in names:
        expected = list(inspect.signature(getattr(theirs, name).__init__).parameters)[1:]
        ours = list(inspect.signature(getattr(pipetrain, name).__init__).parameters)[1:]
        assert ours[: len(expected)] == expected, (name, expected, ours)
        for base in ("PipelineScheduleSingle", "PipelineScheduleMulti"):
            assert issubclass(getattr(pipetrain, name), getattr(pipetrain, base)) == issubclass(
                getattr(theirs, name), getattr(theirs, base)
            ), (name, base)
