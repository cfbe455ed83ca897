"""LeNet as in the multi-GPU chapters of Dive into Deep Learning."""

from torch import nn


class LeNet(nn.Sequential):
    """conv 20@3x3, ReLU, avg-pool, conv 50@5x5, ReLU, avg-pool, 800 -> 128 -> 10, for 28x28 images.

    Weights are drawn from N(0, 0.01) and biases start at zero, as the book's
    from-scratch version does; that small scale is why it needs a large learning rate.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, init_std: float = 0.01) -> None:
        super().__init__(
            nn.Conv2d(in_channels, 20, kernel_size=3),
            nn.ReLU(),
            nn.AvgPool2d(kernel_size=2, stride=2),
            nn.Conv2d(20, 50, kernel_size=5),
            nn.ReLU(),
            nn.AvgPool2d(kernel_size=2, stride=2),
            nn.Flatten(),
            nn.Linear(800, 128),
            nn.ReLU(),
            nn.Linear(128, num_classes),
        )
        for layer in self:
            if isinstance(layer, (nn.Conv2d, nn.Linear)):
                nn.init.normal_(layer.weight, std=init_std)
                nn.init.zeros_(layer.bias)
