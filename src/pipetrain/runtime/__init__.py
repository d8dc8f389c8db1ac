"""pipetrain.runtime: run a lowered :class:`~pipetrain.plan.Schedule` on torch.

The parts, one job each:

* ``prepare``: from the schedule given to what runs (lowering, its options, compiling programs)
* ``executor``: the one interpreter of a rank's compiled program
* ``custom``: what a function registered with ``register_custom_function`` receives
* ``driver``: ``step``/``eval`` shared by the two drivers below
* ``distributed``: :class:`PipelineScheduleRuntime`, one rank on ``torch.distributed``
* ``local``: :class:`LocalPipeline`, every rank in one process
* ``transport``: wire format, point-to-point operations, completion, in-process mailboxes
* ``failures``: a failure anywhere becomes an error everywhere; ranks agree on the schedule
* ``data_parallel``: what UNSHARD, RESHARD and REDUCE_GRAD do on DDP and FSDP2 modules

The torch-compatible classes live in :mod:`pipetrain.schedules` and :mod:`pipetrain.stage`,
named as in ``torch.distributed.pipelining``.
"""

from __future__ import annotations

from pipetrain.runtime.distributed import PipelineScheduleRuntime
from pipetrain.runtime.executor import LossFn
from pipetrain.runtime.failures import announce_failure
from pipetrain.runtime.local import LocalPipeline
from pipetrain.runtime.prepare import DEFAULT_RECV_AHEAD, prepare_schedule, read_torch_csv, require_autograd

__all__ = [
    "DEFAULT_RECV_AHEAD",
    "LocalPipeline",
    "LossFn",
    "PipelineScheduleRuntime",
    "announce_failure",
    "prepare_schedule",
    "read_torch_csv",
    "require_autograd",
]
