"""A new network: any nn.Module that maps (batch, in_channels, H, W) images to (batch, num_classes) logits."""

from torch import nn


class MLP(nn.Sequential):
    """Flatten, one hidden ReLU layer, logits: the smallest network that still learns something."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, image_size: int = 28, hidden: int = 64) -> None:
        super().__init__(
            nn.Flatten(),
            nn.Linear(in_channels * image_size * image_size, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )
