"""Lightning's model summary without a FLOPs count it did not make."""

import logging
from typing import Any

from lightning import Callback
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import get_formatted_model_size, get_human_readable_count

log = logging.getLogger(__name__)


def summary_table(columns: list[tuple[str, list[str]]], totals: list[tuple[str, str]]) -> str:
    """Lightning's layout: the columns under their headers between rules, then one line per total."""
    widths = [max(len(header), *(len(str(cell)) for cell in cells)) for header, cells in columns]
    rule = "-" * (sum(widths) + 3 * (len(columns) + 1))
    rows = [[header for header, _ in columns], *zip(*(cells for _, cells in columns))]
    lines = [" | ".join(f"{str(cell):<{width}}" for cell, width in zip(row, widths)) for row in rows]
    return "\n".join([lines[0], rule, *lines[1:], rule, *(f"{value:<10}{name}" for value, name in totals)])


class SummaryWithoutZeroFlops(ModelSummary):
    """Lightning 2.6 counts FLOPs only by running `example_input_array`, which the classifier lacks (its batches are
    normalised by the data module), and would show a column of zeros and `0 Total Flops`."""

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int,
                  **summarize_kwargs: Any) -> None:
        totals = [
            (get_human_readable_count(trainable_parameters), "Trainable params"),
            (get_human_readable_count(total_parameters - trainable_parameters), "Non-trainable params"),
            (get_human_readable_count(total_parameters), "Total params"),
            (get_formatted_model_size(model_size), "Total estimated model params size (MB)"),
            (str(total_training_modes["train"]), "Modules in train mode"),
            (str(total_training_modes["eval"]), "Modules in eval mode"),
        ]
        if total_flops:
            totals.append((get_human_readable_count(total_flops), "Total Flops"))
        else:
            summary_data = [column for column in summary_data if column[0] != "FLOPs"]
        log.info("\n" + summary_table(summary_data, totals))


def without_zero_flops(callbacks: list[Callback]) -> list[Callback]:
    """Swaps the class of Lightning's own summary (the subclass adds no state): one passed to the Trainer would print
    even with `trainer.enable_model_summary=false`, and Lightning would say one is already configured."""
    for callback in callbacks:
        if type(callback) is ModelSummary:
            callback.__class__ = SummaryWithoutZeroFlops
    return callbacks
