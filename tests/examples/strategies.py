"""A new strategy: any Lightning `Strategy` subclass, named by a conf/strategy file."""

import logging

from lightning import Trainer
from lightning.pytorch.strategies import SingleDeviceStrategy

log = logging.getLogger(__name__)


class AnnouncedSingleDevice(SingleDeviceStrategy):
    """Lightning's one-device strategy, saying in the run's log (train.log) that it set the run up."""

    def setup(self, trainer: Trainer) -> None:
        log.info("AnnouncedSingleDevice: training on %s", self.root_device)
        super().setup(trainer)
