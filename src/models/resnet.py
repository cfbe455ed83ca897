"""ResNet-18 for 28x28 grayscale images, built from torchvision's ResNet."""

from torch import nn
from torchvision.models.resnet import BasicBlock, ResNet


def resnet18(num_classes: int = 10, in_channels: int = 1) -> ResNet:
    """The book's small-image stem: a 3x3 stride-1 convolution and no max-pool, which would shrink 28x28 to 7x7."""
    net = ResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes)
    net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
    net.maxpool = nn.Identity()
    return net
