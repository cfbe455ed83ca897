"""Lightning's model summary without a FLOPs count it did not make."""

import logging
from typing import Any

from lightning import Callback
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table

log = logging.getLogger(__name__)


class SummaryWithoutZeroFlops(ModelSummary):
    """Lightning 2.6 counts FLOPs only by running the module's `example_input_array`; without one it
    shows a FLOPs column of zeros and `0 Total Flops`. Here those are left out; a count it made stays.
    The classifier has no example input: its batches are (images, labels) pairs, normalised by the
    data module, which a bare example tensor would not pass through."""

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        if not total_flops:
            summary_data = [column for column in summary_data if column[0] != "FLOPs"]
        table = _format_summary_table(total_parameters, trainable_parameters, model_size, total_training_modes,
                                      total_flops, *summary_data)
        log.info("\n" + (table if total_flops else table.rpartition("\n")[0]))  # the last row is the total FLOPs


def without_zero_flops(callbacks: list[Callback]) -> list[Callback]:
    """The trainer's callbacks with the model summary Lightning added replaced by `SummaryWithoutZeroFlops`
    of the same depth. Replaced after the Trainer is built: passed in, it would make Lightning print
    that one is already configured, and print it even with `trainer.enable_model_summary=false`."""
    return [SummaryWithoutZeroFlops(max_depth=c._max_depth, **c._summarize_kwargs) if type(c) is ModelSummary else c
            for c in callbacks]
