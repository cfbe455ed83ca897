"""LeNet as in the multi-GPU chapters of Dive into Deep Learning, with options of this project's own."""

from torch import nn

POOLS = {"avg": nn.AvgPool2d, "max": nn.MaxPool2d}
INITS = ("normal", "kaiming")


class LeNet(nn.Sequential):
    """The defaults are the book's network, weights from N(0, 0.01): that small scale is why it needs a large rate.
    `batch_norm`, `pool=max` and `init=kaiming` (He et al., 2015) are `experiment=lenet_plus` (docs/results.md)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, init_std: float = 0.01,
                 batch_norm: bool = False, pool: str = "avg", init: str = "normal") -> None:
        for name, value, allowed in (("pool", pool, POOLS), ("init", init, INITS)):
            if value not in allowed:
                raise ValueError(f"{name}={value!r}; choose one of: {', '.join(allowed)}")

        def block(layer: nn.Module, features: int, norm: type[nn.Module]) -> list[nn.Module]:
            return [layer, *([norm(features)] if batch_norm else []), nn.ReLU()]

        super().__init__(
            *block(nn.Conv2d(in_channels, 20, kernel_size=3), 20, nn.BatchNorm2d),
            POOLS[pool](kernel_size=2, stride=2),
            *block(nn.Conv2d(20, 50, kernel_size=5), 50, nn.BatchNorm2d),
            POOLS[pool](kernel_size=2, stride=2),
            nn.Flatten(),
            *block(nn.Linear(800, 128), 128, nn.BatchNorm1d),
            nn.Linear(128, num_classes),
        )
        for layer in self:
            if isinstance(layer, (nn.Conv2d, nn.Linear)):
                if init == "kaiming":
                    nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
                else:
                    nn.init.normal_(layer.weight, std=init_std)
                nn.init.zeros_(layer.bias)
