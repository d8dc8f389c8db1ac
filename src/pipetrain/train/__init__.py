"""``pipetrain train``: a small GPT, offline text, a launcher and the training loop.

Also a worked example of using pipetrain: ``model`` (a GPT that cuts into stages), ``data``
(the standard library's source as bytes), ``launch`` (torchrun or local processes) and ``loop``
(the pipelined training and its non-pipelined reference).
"""

from __future__ import annotations

from pipetrain.train.loop import TrainConfig, TrainResult, reference_losses, run_rank
from pipetrain.train.model import GPT, MODEL_SIZES, GPTConfig, lm_loss

__all__ = ["GPT", "MODEL_SIZES", "GPTConfig", "TrainConfig", "TrainResult", "lm_loss", "reference_losses", "run_rank"]
